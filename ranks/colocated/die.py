"""A colocated die (xDeepServe §4.1-4.3, Figure 10): one DP group (TP=1) that also hosts expert
slots. Each iteration every die runs attention on its own requests and meets all the others at
every MoE layer's dispatch and combine, even with nothing to send.

With `ems.enabled` (no PD) the colocated dies are the EMS pool's clients (docs/ems.md): a
request's longest cached prefix is pulled when it reaches the die and written into its first KV
slots on admission (its chunked prefill starts after them); when its prompt is done, its
computed full blocks are put, sent without waiting (ranks/ems/client.py).
"""

from __future__ import annotations

from mpi4py import MPI

from ranks.colocated.eplb_hooks import make_eplb_die
from ranks.colocated.replicas import ring_expert_map
from ranks.colocated.weights_pull import LoadingExecutor, standby_weights
from ranks.core.context import RankContext
from ranks.core.decode_die import DecodeDieLoop
from ranks.core.die_io import DieTotals, Inbox, Outbox, serve
from ranks.core.die_parts import decode_state, decode_totals, make_pricer
from ranks.core.handshake import handshake
from ranks.core.weights_window import weights_window
from ranks.faults.dead import dead_die
from ranks.faults.stuck import stall
from ranks.recovery import scale_down
from ranks.recovery.memory import memory_check
from ranks.recovery.recompute import Recomputer
from ranks.recovery.watch import DieHealth, is_watched, watch_comm, watcher
from xccl.agreement import IdleBackoff
from xccl.ep.buffer import EpBuffer
from xccl.gmem import DieMemory
from xccl.vclock import VirtualClock
from xds_mpi.execution.executor import ColocatedExecutor
from xds_mpi.execution.slots import ExpertSlots
from xds_mpi.model.weights import build_model
from xds_mpi.report import trace


def run(ctx: RankContext) -> None:
    handshake(ctx)
    serve(ColocatedDie(ctx))


class ColocatedDie(DecodeDieLoop):
    def __init__(self, ctx: RankContext) -> None:
        cfg, topo, plan = ctx.cfg, ctx.topo, ctx.plan
        self.world = ctx.comm
        rank = ctx.comm.rank
        rows = plan.ep.row_regions(rank) if rank in plan.ep.members else ()
        self.mem = DieMemory(ctx.comm, plan.window_bytes[rank], unzeroed=rows)
        self.dies = ctx.comm.Split(1, ctx.comm.rank)  # the dies only (the shell: color 0)
        window = weights_window()  # with standby TEs: every die's weights, its fork table
        # A standby TE's die: zeroed weights until its scale-out (ranks/colocated/weights_pull.py)
        self.standby = standby_weights(ctx.comm, cfg, window)
        source = self.standby.source() if self.standby is not None else None
        # read by a fork: its iterations during it slowed (xds_mpi/scaling/contention.py)
        self.fork_table = window if window is not None and window.layout is not None else None
        model = build_model(cfg.model, unpacked_under=cfg.run.output_dir, source=source)
        state = decode_state(cfg, model)
        slots = ExpertSlots.from_topology(topo)
        self.clock = clock = VirtualClock()
        # One EP lane per microbatch (two: the two-stream decode, xds_mpi/execution/two_streams.py)
        lanes = tuple(
            EpBuffer(
                self.mem,
                plan.ep.lane(i),
                slots.slot_owner,
                dtype=plan.row_dtype,
                clock=clock,
                num_cores=cfg.xccl.num_cores,
                timeout_s=cfg.xccl.poll_timeout_s,
                wait_log=trace.wait_log(),  # None while tracing is off
            )
            for i in range(plan.ep.num_lanes)
        )
        self.pricer = make_pricer(cfg, clock, slots)
        self.scheduler = state.scheduler
        self.executor = self._executor(ctx, model, lanes, state, slots)
        if self.standby is None:  # (a standby die's: once its weights arrived)
            self.executor.build_hosted_experts()
        self.ems = self._ems_client(ctx, state.cache)
        self._failure_side(ctx, model)
        self.recompute = self._recomputer(ctx, lanes)
        is_virtual = ctx.plan.clock.is_virtual
        self.eplb = make_eplb_die(cfg, ctx.comm, self.executor, self.pricer, is_virtual=is_virtual)
        self.inbox = Inbox(ctx.comm, self.scheduler)
        self.vtime = self._virtual_time(ctx)  # run.clock virtual: None on the wall clock
        self.outbox = Outbox(
            ctx.comm,
            ctx.comm.rank,
            timeout_s=cfg.xccl.poll_timeout_s,
            clock=clock if self.vtime is not None else None,
        )
        self.memory = memory_check(ctx)  # §6.2 stage 3: None without a memory row for the die
        self.idle = IdleBackoff()  # between agreement rounds while no die has work
        self.eplb_agreed = (0, 1)  # EPLB's boundary as the dies last agreed it (agree)
        self.loaded = None  # a standby die's load once done (its report to complete)

    def _virtual_time(self, ctx: RankContext):
        """Virtual-time serving's side of this die (ranks/colocated/virtual_time.py), or None."""
        if not ctx.plan.clock.is_virtual:
            return None
        from ranks.colocated.virtual_time import DieVirtualTime
        from xds_mpi.plan.failures.loss import release_bound_s

        # The TE-shell's next grant may wait out a failover: detection, fence and rebuild.
        timeout_s = ctx.cfg.xccl.poll_timeout_s + release_bound_s(ctx.cfg.health)
        return DieVirtualTime(
            ctx.comm, self.clock, self.scheduler, timeout_s=timeout_s, **self.granted_by(ctx)
        )

    def granted_by(self, ctx: RankContext) -> dict:
        """Who grants this die its requests on the virtual clock, and what they become here
        (DieVirtualTime's defaults: the TE-shell, the scheduler's waiting queue)."""
        return {}

    def news_sent(self) -> int:
        """Messages the granting shell takes before it decides: the token batches (they carry
        the finishes)."""
        return self.outbox.num_batches

    def _ems_client(self, ctx: RankContext, cache):
        """The EMS pool's client when this die uses the pool (colocated without PD), else None."""
        if ctx.plan.ems is None or ctx.comm.rank not in ctx.plan.ems.clients:
            return None
        # Lazy import, with EMS only: hashlib and the client (docs/scale.md).
        from ranks.ems.client import EmsClient

        self.scheduler.prefix_hits = {}
        return EmsClient(ctx, self.mem, cache)

    def _pull_prefixes(self) -> None:
        """EMS: each request that reached the die since the last call, its longest cached
        prefix pulled (priced on this die's projected clock) and held for its admission; what
        was held for a request no longer here (cancelled) dropped (ranks/ems/client.py)."""
        self.ems.pull_arrivals(self.scheduler, self.pricer)

    def _put_prompts(self, sampled) -> None:
        """EMS: the prompts this iteration finished (their first token sampled): their computed
        full blocks to the pool, before a request that ends here frees its blocks."""
        for req_id in sampled:
            seq = self.scheduler.running[req_id]
            if seq.num_generated == 0:
                self.ems.put(seq.req, self.scheduler.table.slots(req_id))

    def _failure_side(self, ctx: RankContext, model) -> None:
        """Ring replicas (§6.2: a replica of every expert on another die) and the heartbeats
        answered from this loop (§6.1, ranks/recovery/watch.py)."""
        cfg, topo = ctx.cfg, ctx.topo
        if cfg.health.replicas == "ring":
            moe_layers = self.executor.moe_layers()
            fixed = cfg.eplb.enabled  # EPLB balances the other redundant slots
            self.executor.expert_map = ring_expert_map(topo, model, moe_layers, fixed=fixed)
        self.topo, self.retired = topo, []  # retired: (comm, window) pairs of a failover
        self.health_cfg = cfg.health  # a failover's price on the virtual clock
        self.is_scaled = self.is_lost = False
        self.health = None
        if is_watched(cfg, ctx.plan):
            # PD: the decode TE-shell watches
            self.health = DieHealth(cfg, ctx.comm, shell=watcher(ctx.plan))
        # Fault injection (ranks/faults/), only on a die a dead row names: None elsewhere
        self.dead = dead_die(cfg, ctx.comm.rank, self.health, self.clock)

    def _recomputer(self, ctx: RankContext, lanes) -> Recomputer:
        """Token recomputation (§6.2 stage 3) over every EP lane; with heartbeats, its abort-word
        window spans the TE-shell too, which fences the waits through it (§6.1)."""
        return Recomputer(
            ctx.cfg,
            self.dies,
            ctx.comm.rank,
            list(lanes),
            self.pricer,
            events=self.executor.events,
            log=ctx.log,
            window_comm=watch_comm(ctx) if self.health else None,
            stall=stall(ctx.cfg, ctx.comm, self, self.health),  # None but on a stuck row's die
        )

    def _executor(self, ctx: RankContext, model, lanes, state, slots):
        cfg, topo = ctx.cfg, ctx.topo
        is_dedicated = cfg.deployment.shared_experts == "dedicated"
        executor = ColocatedExecutor if self.standby is None else LoadingExecutor
        return executor(
            model,
            lanes[0],
            lanes=lanes if len(lanes) > 1 else (),
            phy2log=topo.phy2log,
            log2phy=topo.log2phy(),
            table=state.table,
            cache=state.cache,
            pricer=self.pricer,
            slots=slots,
            shared_slots=slots.dedicated_shared_slots if is_dedicated else (),
            mtp_depth=cfg.scheduler.mtp_depth,
        )

    @property
    def iteration_start_s(self) -> float:
        """The running iteration's virtual start (a stuck row's at_s); -1 on the wall clock."""
        return self.vtime.start_s if self.vtime is not None else -1.0

    @property
    def busy_iterations(self) -> int:
        """Iterations run, the same count on every die (a fault row's `iteration` is one)."""
        return self.executor.num_iterations

    def rebuild(self, failover: scale_down.Failover) -> None:
        """Go on without `failover.lost` (ranks/recovery/scale_down.py, die steps 1-4)."""
        self.recompute.restore_interrupted()  # Step 1
        self.retired.append((self.dies, self.executor.ep.mem))
        self.dies = scale_down.survivors(self.dies, self.world, failover.lost)  # Step 2
        ep = self.executor.ep.rebuilt(self.dies)
        self.executor.use_buffer(ep)
        self.recompute.regroup(self.dies, [ep])  # the vote moves with the buffer
        # A die whose iteration was done before the fence reached it has counted it, while the
        # fence undid it on the others (across hosts the fence's word can overtake the last
        # combine's records): every survivor takes the highest count, as the afd dies do
        # (ranks/afd/common.py), so that all number the next iteration's events alike.
        self.executor.restore(self.dies.allreduce(self.executor.num_iterations, op=MPI.MAX))
        self.is_scaled = True
        self.pricer.rescale(scale_down.num_routed_dies_left(self.topo, failover.lost))
        if failover.eplb_placement is not None:  # Step 3
            self.eplb.take_over(failover.eplb_placement, failover.eplb_version)
        else:
            expert_map = self.executor.expert_map
            left = scale_down.without_dies(expert_map.placement, self.topo, failover.lost)
            expert_map.install(left)
        fault_s = self._priced_failover()  # virtual clock: past the failover (-1 on the wall)
        scale_down.send_ready(self.world, self.health.shell, self.outbox.num_batches, fault_s)

    def _priced_failover(self) -> float:
        """run.clock virtual: this die's clock moved past the failover's priced cost
        (ranks/colocated/virtual_time.py failed_over); the clock before, seconds (-1: wall)."""
        if self.vtime is None:
            return -1.0
        from xds_mpi.plan.failures.loss import FailoverCost

        return self.vtime.failed_over(FailoverCost.of(self.health_cfg).total_s)

    def xccl_buffer(self):
        return self.executor.ep

    def take_weights(self, *, wait: bool) -> None:
        """A standby die: its weights pulled once its TE-shell passed on the scale-out (`wait`:
        before its first busy iteration, the order must come), then it serves as any die."""
        model = self.standby.take(wait=wait)
        if model is not None:
            self.executor.take_model(model)
            self.loaded, self.standby = self.standby, None

    def iterate(self) -> bool:
        """One iteration, as Figure 10: policy (scheduler) and execution (executor) apart."""
        if self.standby is not None:
            self.take_weights(wait=False)  # the scale-out's weights, when they are ordered
        self.inbox.poll()  # requests / stop from the TE-shell
        if self.vtime is not None:
            self.vtime.take_grants()  # requests and the horizon (virtual time)
            if self.vtime.is_held(self.inbox.is_stopped):  # parked: out of the agreement
                self.agreement_fence()  # a fence still releases it (decode_die.py)
                return True
        if self.eplb.is_waiting(self.inbox.is_stopped):  # virtual: EPLB's decision first
            self.agreement_fence()
            return True
        if self.ems is not None:
            self._pull_prefixes()
        self.before_agree()
        busy, all_stopped, stopping = self.agree()  # all dies run the same iterations
        # Virtual time: where this die stands, to the TE-shell; held at the horizon?
        is_held = self.vtime is not None and self.vtime.after_agree(busy, self.news_sent())
        if not busy:
            if all_stopped:  # every die leaves now, without an idle round's sleep first
                return False
            if not stopping:  # (once one die has the stop, the others have it on their way)
                self.idle.idle()  # idle polling backs off
            return True
        if is_held:  # parked at the horizon until the TE-shell's next grant
            return True
        if self.standby is not None:  # a standby die's first busy iteration: its weights first
            self.take_weights(wait=True)
        self.idle.busy()
        if self.vtime is not None:
            self.vtime.begin()  # at the dies' common virtual start
            if self.fork_table is not None:  # read by a fork now: its share of the UB link
                self.pricer.link_factor = self.fork_table.link_factor_at(self.vtime.start_s)
            if self.dead is not None and self.dead.at_start(
                self.vtime.start_s, self.busy_iterations
            ):
                self.dead = None  # an at_s dead row: silent from this iteration on
                return True
        if self.ems is None:  # (with EMS a request's prefix is looked up before the agreement)
            # Requests that reached this die during the agreement join this iteration, not the
            # next: at a burst of arrivals a die that polled just before its requests came
            # otherwise ran its first busy iteration empty, which doubled their TTFT.
            self.inbox.poll()
        self.eplb.at_boundary(
            self.eplb_agreed
        )  # §4.5 Step 3: replica swap phases, at a boundary all agree on
        sampled, timing = self.iteration()  # re-executed after a transient fault
        if self.dead is not None:  # a dead row of this die (ranks/faults/dead.py)
            self.dead = self.dead.after(self.busy_iterations)
        if self.ems is not None:
            self._put_prompts(sampled)
        emitted = self.scheduler.postprocess(sampled)  # finished requests free their blocks
        if self.vtime is not None:
            self.vtime.end()
        finished = {e.req_id for e in emitted if e.is_finished}
        self.executor.commit(finished | self.inbox.take_cancelled())
        self.emit(emitted, timing)  # the output shortcut
        self.eplb.after_iteration()  # §4.5 Step 1: expert counts to the TE-shell every interval
        return True

    def before_agree(self) -> None:
        """Work between iterations before the dies agree (PD: KV transfers, ranks/pd/decode.py)."""
        if self.memory is not None:
            self.memory.check(self, self.busy_iterations)

    def emit(self, emitted, timing) -> None:
        """Stream the iteration's tokens to the TE-shell (PD adds the prefill's first tokens)."""
        self.outbox.stream(emitted, timing)

    def iteration(self):
        """Schedule and run one iteration; after a fault anywhere (§6.2 stage 3: an injected
        XCCL error, another die's abort word, a timed-out wait with faults.on_timeout
        recompute) every die votes, is restored to the iteration's start and runs it again."""
        recompute = self.recompute
        with recompute.checkpoint(self.executor.num_iterations, (self.scheduler, self.executor)):
            while True:
                try:
                    result = self.attempt()
                except recompute.failures as exc:  # () without faults configured
                    recompute.fail(exc)  # the abort word, the vote, the die restored
                    continue
                if not recompute.is_voting or recompute.vote():  # every die completed it
                    return result

    def attempt(self):
        entries = self.scheduler.schedule()  # continuous batching, chunked prefill
        return self.executor.forward(entries)  # MLA, gate, dispatch, experts, combine

    def agree(self) -> tuple[bool, bool, bool]:
        """(does any die have work, has every die been told to stop, has some die: the TE-shell
        tells every die at once), and EPLB's boundary
        (ranks/colocated/eplb.py): one-sided, over the dies' windows (xccl/agreement.py), no MPI
        collective in the die loop (§4.2)."""
        # word 1: running (bit 0) and, on the virtual clock, the newest grant taken (the rest)
        grant = self.vtime.seq if self.vtime is not None else 0
        mine = (self.scheduler.num_active, (grant << 1) | (0 if self.inbox.is_stopped else 1))
        clock_words = self.vtime.words() if self.vtime is not None else ()
        fence, timeout_s = self.agreement_fence()  # a lost die never writes (decode_die.py)
        rows = self.executor.ep.agreement.agree(
            (*mine, *self.eplb.boundary_values(), *clock_words),
            interrupt=fence,
            timeout_s=timeout_s,
        )
        if self.vtime is not None:
            self.vtime.agreed(rows[:, 4:6], grants=rows[:, 1] >> 1)
        self.eplb_agreed = (int(rows[:, 2].min()), int(rows[:, 3].min()))
        running = rows[:, 1] & 1
        return bool(rows[:, 0].sum()), not running.any(), not running.all()

    def totals(self) -> DieTotals:
        self.eplb.flush()  # the last count slice goes before the die's report
        totals = decode_totals(self.executor, self.pricer, self.recompute, self.scheduler)
        if self.ems is not None:  # every put sent (bounded) and the pool ranks told done
            totals.ems.update(self.ems.close())
        return totals

    def drain(self) -> None:
        self.outbox.drain()
        if self.loaded is not None:
            self.loaded.drain()
        if self.vtime is not None:
            self.vtime.drain()

    def close(self) -> None:
        self.eplb.close()
        super().close()
