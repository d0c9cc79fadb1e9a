"""A colocated die (xDeepServe §4.1-4.3, Figure 10): one DP group (TP=1) that also hosts expert
slots. Each iteration every die runs attention on its own requests and meets all the others at
every MoE layer's dispatch and combine, even with nothing to send."""

from __future__ import annotations

from mpi4py import MPI

from ranks.colocated.eplb import make_eplb_die
from ranks.core.context import RankContext
from ranks.core.die_io import SHELL, DieTotals, Inbox, Outbox, serve
from ranks.core.die_parts import decode_state, decode_totals, make_pricer
from ranks.core.handshake import handshake
from ranks.core.messages import TAG_STOP
from ranks.recovery.die_failover import scale_down, take_failover
from ranks.recovery.die_health import DieHealth, is_watched, watch_comm, watcher
from ranks.recovery.memory_check import MemoryCheck
from ranks.recovery.recompute import Recomputer
from xccl.agreement import IdleBackoff
from xccl.recovery.rollback import Released
from xds_mpi.report import trace


def run(ctx: RankContext) -> None:
    handshake(ctx)
    serve(ColocatedDie(ctx))


class ColocatedDie:
    def __init__(self, ctx: RankContext) -> None:
        from xccl.ep.buffer import EpBuffer
        from xccl.gmem import DieMemory
        from xccl.vclock import VirtualClock
        from xds_mpi.engine.slots import ExpertSlots
        from xds_mpi.model.weights import build_model

        cfg, topo, plan = ctx.cfg, ctx.topo, ctx.plan
        self.mem = DieMemory(ctx.comm, plan.window_bytes[ctx.comm.rank])
        self.dies = ctx.comm.Split(1, ctx.comm.rank)  # the dies only (the shell: color 0)
        model = build_model(cfg.model)
        state = decode_state(cfg, model)
        slots, clock = ExpertSlots.from_topology(topo), VirtualClock()
        ep = EpBuffer(
            self.mem,
            plan.ep,
            slots.slot_owner,
            dtype=plan.row_dtype,
            clock=clock,
            num_cores=cfg.xccl.num_cores,
            timeout_s=cfg.xccl.poll_timeout_s,
            wait_span=trace.span,
        )
        self.pricer = make_pricer(cfg, clock, slots)
        self.scheduler = state.scheduler
        self.executor = self._executor(ctx, model, ep, state, slots)
        self._failure_side(ctx, model, clock)
        self.recompute = self._recomputer(ctx, ep)
        self.eplb = make_eplb_die(cfg, ctx.comm, self.executor, self.pricer)
        self.inbox = Inbox(ctx.comm, self.scheduler)
        self.outbox = Outbox(ctx.comm, ctx.comm.rank, timeout_s=cfg.xccl.poll_timeout_s)
        self.memory = MemoryCheck(
            ctx
        )  # §6.2 stage 3: KV memory faults (ranks/recovery/memory_check.py)
        self.idle = IdleBackoff()  # between agreement rounds while no die has work
        self.eplb_agreed = (0, 1)  # EPLB's boundary as the dies last agreed it (agree)

    def _failure_side(self, ctx: RankContext, model, clock) -> None:
        """Ring replicas (§6.2: a replica of every expert on another die) and the heartbeats
        answered from this loop (§6.1, ranks/recovery/die_health.py)."""
        cfg, topo = ctx.cfg, ctx.topo
        if cfg.health.replicas == "ring":
            from ranks.colocated.replicas import ring_expert_map

            moe_layers = self.executor.moe_layers()
            fixed = cfg.eplb.enabled  # EPLB balances the other redundant slots
            self.executor.expert_map = ring_expert_map(topo, model, moe_layers, fixed=fixed)
        self.topo, self.retired = topo, []  # retired: (comm, window) pairs of a failover
        self.is_scaled = self.is_lost = False
        self.health = None
        if is_watched(cfg, ctx.plan):
            self.health = DieHealth(
                cfg,
                ctx.comm,
                iteration=lambda: self.executor.num_iterations,
                virtual_s=lambda: clock.now_ns / 1e9,
                shell=watcher(ctx.plan),  # PD: the decode TE-shell
            )

    def _recomputer(self, ctx: RankContext, ep) -> Recomputer:
        """Token recomputation (§6.2 stage 3); with heartbeats, its abort-word window spans the
        TE-shell too, which fences the waits through it (§6.1)."""
        return Recomputer(
            ctx.cfg,
            self.dies,
            ctx.comm.rank,
            [ep],
            self.pricer,
            events=self.executor.events,
            log=ctx.log,
            window_comm=watch_comm(ctx) if self.health else None,
            stall=self.health.stall if self.health else None,
        )

    def _executor(self, ctx: RankContext, model, ep, state, slots):
        from xds_mpi.engine.executor import ColocatedExecutor

        cfg, topo = ctx.cfg, ctx.topo
        is_dedicated = cfg.deployment.shared_experts == "dedicated"
        return ColocatedExecutor(
            model,
            ep,
            phy2log=topo.phy2log,
            log2phy=topo.log2phy(),
            table=state.table,
            cache=state.cache,
            pricer=self.pricer,
            slots=slots,
            shared_slots=slots.dedicated_shared_slots if is_dedicated else (),
            mtp_depth=cfg.scheduler.mtp_depth,
        )

    def step(self) -> bool:
        """One turn of the event loop: heartbeats answered here only (§6.1), then an iteration.
        A die released by the TE-shell's fence, or a dead one, only idles from then on."""
        health = self.health
        if health is None:
            return self.iterate()
        health.check_dead()
        if health.is_out:
            return self.out_turn()
        health.answer()
        try:
            return self.iterate()
        except Released:
            health.released()
            return True

    def out_turn(self) -> bool:
        """A turn out of the iterations: a released survivor waits to be told which dies are
        lost and goes on without them (ranks/recovery/die_failover.py); a lost die idles until the
        job's
        end, which it leaves without a collective (`leave`)."""
        comm = self.outbox.comm
        failover = None if self.health.is_dead else take_failover(comm, self.health.shell)
        if failover is not None:
            scale_down(self, failover)
            self.health.is_released = False
            return True
        if comm.iprobe(source=SHELL, tag=TAG_STOP):
            comm.recv(source=SHELL, tag=TAG_STOP)
            self.is_lost = True
            return False
        self.health.idle()
        return True

    def iterate(self) -> bool:
        """One iteration, as Figure 10: policy (scheduler) and execution (executor) apart."""
        self.inbox.poll()  # requests / stop from the TE-shell
        self.before_agree()
        busy, all_stopped = self.agree()  # all dies run the same iterations
        if not busy:  # idle polling backs off
            self.idle.idle()
            return not all_stopped
        self.idle.busy()
        self.eplb.at_boundary(
            self.eplb_agreed
        )  # §4.5 Step 3: replica swap phases, at a boundary all agree on
        sampled, timing = self.iteration()  # re-executed after a transient fault
        emitted = self.scheduler.postprocess(sampled)  # finished requests free their blocks
        self.executor.commit({e.req_id for e in emitted if e.is_finished})
        self.emit(emitted, timing)  # the output shortcut
        self.eplb.after_iteration()  # §4.5 Step 1: expert counts to the TE-shell every interval
        return True

    def before_agree(self) -> None:
        """Work between iterations before the dies agree (PD: KV transfers, ranks/pd/decode.py)."""
        self.memory.check(self)

    def emit(self, emitted, timing) -> None:
        """Stream the iteration's tokens to the TE-shell (PD adds the prefill's first tokens)."""
        self.outbox.stream(emitted, timing)

    def iteration(self):
        """Schedule and run one iteration; on an injected fault anywhere, restore and again."""
        return self.recompute.run(
            self.executor.num_iterations, self.attempt, state=(self.scheduler, self.executor)
        )

    def attempt(self):
        entries = self.scheduler.schedule()  # continuous batching, chunked prefill
        return self.executor.forward(entries)  # MLA, gate, dispatch, experts, combine

    def agree(self) -> tuple[bool, bool]:
        """(does any die have work, has every die been told to stop), and EPLB's boundary
        (ranks/colocated/eplb.py): one-sided, over the dies' windows (xccl/agreement.py), no MPI
        collective in the die loop (§4.2)."""
        mine = (self.scheduler.num_active, 0 if self.inbox.is_stopped else 1)
        fence = timeout_s = None
        if self.health is not None:  # a lost die never writes: the TE-shell's fence releases us
            fence = self.recompute.recovery.check_fence
            fence()  # a fence seen even by a die that never waits
            # As long as a vote waits (faults.on_timeout recompute: past detection and release)
            timeout_s = self.recompute.recovery.vote_timeout_s
        rows = self.executor.ep.agreement.agree(
            (*mine, *self.eplb.boundary_values()), interrupt=fence, timeout_s=timeout_s
        )
        self.eplb_agreed = (int(rows[:, 2].min()), int(rows[:, 3].min()))
        return bool(rows[:, 0].sum()), not rows[:, 1].any()

    def totals(self) -> DieTotals:
        self.eplb.flush()  # the last count slice goes before the die's report
        return decode_totals(self.executor, self.pricer, self.recompute)

    def close(self) -> None:
        self.eplb.close()
        self.outbox.drain()
        if self.health is not None:
            self.health.close()
        if self.is_scaled:  # the old windows span lost dies: their frees would never return
            self.executor.ep.mem.free()
            self.dies.Free()
            return
        self.recompute.free()
        self.mem.free()
        self.dies.Free()

    def leave(self) -> None:
        """A lost die at the job's end: its own sends completed, what the TE-shell sent it
        meanwhile (requests, pings) taken, no collective."""
        self.outbox.drain()
        self.health.close()
        comm = self.outbox.comm
        while (message := comm.improbe(source=SHELL, tag=MPI.ANY_TAG)) is not None:
            message.recv()
