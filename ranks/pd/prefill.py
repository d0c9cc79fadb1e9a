"""A prefill die (xDeepServe §5.1 steps 2-3 and 6-8, its side): one prefill DP group.

The dies of one prefill TE run in lockstep like colocated dies (every MoE layer is a
dispatch/combine among them, engine/executor.py on their TE's EP group); TEs never wait on each
other. Each step: the TE's leader (its DP-0, which plays the TE-shell: the JE sends the TE's
requests straight to it) takes new requests into the TE's shared pending pool; while requests
are pending
every group sends it its status and it assigns them (engine/pd_prefill.py `assign`, §4.3's
single-level collaborative scheduler); the dies prefill (main model + MTP modules over the
prompt), and each finished prompt becomes a PD-transfer task (metadata and block addresses) sent
to the JE. When a decode die asks (KvPull: its irecv is posted), the die isends the latent KV
(ranks/pd/send.py); a completed send frees the blocks. With ems.enabled a die pulls each
assigned prompt's longest cached prefix from the EMS pool and puts its computed full blocks
there once the prompt is done (ranks/ems/client.py, docs/ems.md).

With `deployment.prefill_tp` > 1 a prefill DP group is a TP group of that many dies
(xds_mpi/execution/prefill_tp.py): the leader schedules per group (one status per group, every die
of a group handed the same requests), every die of the group runs the same batch, its share of
the rows and of the attention heads (SP-TP-SP), and only the group's leader hands finished
prompts over and sends their KV; the others free their copy of the blocks at once.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ranks.core.context import RankContext
from ranks.core.control import wait_all
from ranks.core.die_io import SHELL
from ranks.core.handshake import handshake
from ranks.core.messages import TAG_REQUEST, TAG_STOP, TAG_TOKENS, TokenBatch
from ranks.core.ready import report_ready
from ranks.pd.messages import TAG_PD_PREFILLED
from ranks.pd.prefill_loss import PrefillLoss
from ranks.pd.send import KvSender
from ranks.recovery.watch import HeartbeatResponder
from xccl.gmem import DieMemory
from xccl.tp_gather import TpGather
from xccl.vclock import LinkModel
from xds_mpi.config.hardware import load_profile
from xds_mpi.execution.prefill_tp import TpPrefillExecutor, TpPricer


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """The leader's decision for one prefill DP group: its requests, the leader's virtual time
    when each entered the pool (projected queueing starts there: the prefill dies' clocks move
    together, every MoE layer meeting at dispatch/combine), and how many were assigned in all."""

    requests: tuple
    pooled_v: tuple[float, ...]
    num_assigned: int


def run(ctx: RankContext) -> None:
    handshake(ctx)
    if ctx.plan.pd is None:
        report_ready(ctx.comm)
        return  # pd off: prefill dies stay idle (the decode dies prefill in chunks)
    die = PrefillDie(ctx)
    report_ready(ctx.comm)
    while die.step():
        pass
    die.close()


class PrefillDie:
    def __init__(self, ctx: RankContext) -> None:
        plan, rank = ctx.plan, ctx.comm.rank
        self.ctx, self.comm, self.rank = ctx, ctx.comm, rank
        self.mem = DieMemory(ctx.comm, plan.window_bytes[rank])
        self.te = plan.pd.te_of(rank)
        # this TE's dies (decode dies use color 1, hosts 0)
        self.group = ctx.comm.Split(2 + self.te, rank)
        self.is_leader = rank == plan.pd.leaders[self.te]
        self.tp = plan.pd.tp
        self.is_tp_leader = rank == plan.pd.tp_group_of(rank)[0]  # sends its group's KV
        self._build(ctx)
        self.sender = KvSender(ctx, self.mem, self.cache, self.scheduler, self.pricer)
        self.ems = None  # the EMS context cache (ranks/ems/client.py), with ems.enabled
        if plan.ems is not None:
            # Lazy import, with EMS only: hashlib and the client, a start-up cost otherwise.
            from ranks.ems.client import EmsClient

            self.ems = EmsClient(ctx, self.mem, self.cache)
            self.scheduler.prefix_hits = {}
        self.pool: deque = deque()  # leader: requests shared by every prefill DP group
        self.pooled_v: dict[int, float] = {}  # leader: req -> its virtual time entering the pool
        self.cached: dict[int, int] = {}  # leader, EMS: req -> prompt tokens the pool holds
        self.assigned: dict[int, tuple[float, float]] = {}  # req -> (wall, pooled virtual s)
        self.started: dict[int, tuple[float, float]] = {}  # req -> first prefill step
        self.is_stopped = False
        self.sends: list[MPI.Request] = []
        # §6.1: the JE (control plane) pings each TE's leader, which plays its TE-shell
        self.heartbeat = HeartbeatResponder(ctx.comm, SHELL) if self.is_leader else None
        self.loss = PrefillLoss(ctx.cfg, rank)  # an injected dead / stuck die (emulated)
        self.vtime = None  # run.clock virtual: the TE's side of it (ranks/pd/prefill_vtime.py)
        if plan.clock.is_virtual:
            from ranks.pd.prefill_vtime import PrefillVirtualTime

            self.vtime = PrefillVirtualTime(
                ctx.comm, self.group, self.pricer.clock, is_leader=self.is_leader
            )

    def _build(self, ctx: RankContext) -> None:
        # Lazy import, an idle prefill die (pd off) never builds: a start-up cost otherwise.
        from ranks.colocated.weights_pull import LoadingExecutor, standby_weights
        from ranks.core.die_parts import decode_state, make_pricer
        from ranks.core.weights_window import weights_window
        from xccl.ep.buffer import EpBuffer
        from xccl.vclock import VirtualClock
        from xds_mpi.execution.executor import ColocatedExecutor
        from xds_mpi.execution.slots import ExpertSlots
        from xds_mpi.model.weights import build_model
        from xds_mpi.pd.prefill import PrefillScheduler

        cfg, pd = ctx.cfg, ctx.plan.pd
        # A standby pair's die: zeroed weights until its scale-out (ranks/colocated/weights_pull.py)
        self.standby = standby_weights(ctx.comm, cfg, weights_window())
        self.loaded = None  # its load once done (the report to complete)
        source = self.standby.source() if self.standby is not None else None
        model = build_model(cfg.model, unpacked_under=cfg.run.output_dir, source=source)
        state = decode_state(cfg, model, PrefillScheduler)
        slot_owner = pd.slot_owners[self.te]
        num_experts = len(slot_owner)
        slots = ExpertSlots(slot_owner=slot_owner, num_routed_slots=num_experts, shared_slot_of={})
        clock = VirtualClock()
        # One EP lane per microbatch (two: the prefill pipeline, xds_mpi/execution/two_streams.py)
        lanes = tuple(
            EpBuffer(
                self.mem,
                pd.eps[self.te].lane(i),
                slots.slot_owner,
                dtype=ctx.plan.row_dtype,
                clock=clock,
                num_cores=cfg.xccl.num_cores,
                timeout_s=cfg.xccl.poll_timeout_s,
            )
            for i in range(pd.eps[self.te].num_lanes)
        )
        self.pricer = make_pricer(cfg, clock, slots, profile=cfg.pd.prefill_profile)
        self.scheduler, self.cache, self.hidden = state.scheduler, state.cache, cfg.model.hidden
        executor, tp = ColocatedExecutor if self.standby is None else LoadingExecutor, {}
        if pd.tp > 1:
            executor, tp = self._tp_parts(ctx, clock)
        self.executor = executor(
            model,
            lanes[0],
            lanes=lanes if len(lanes) > 1 else (),
            phy2log=tuple(range(num_experts)),
            log2phy=tuple((e,) for e in range(num_experts)),
            table=state.table,
            cache=state.cache,
            pricer=self.pricer,
            slots=slots,
            mtp_depth=cfg.scheduler.mtp_depth,
            **tp,
        )

    def _tp_parts(self, ctx: RankContext, clock):
        """A TP group's die (xds_mpi/execution/prefill_tp.py): its executor class and gather, and
        its pricer (replacing `self.pricer`)."""
        cfg, pd, topo = ctx.cfg, ctx.plan.pd, ctx.plan.topo
        layout = pd.tp_layout_of(self.rank)
        servers = {topo.ranks[r].server for r in layout.members}
        profile = cfg.pd.prefill_profile or cfg.hardware.profile
        base = self.pricer
        self.pricer = TpPricer(
            base.cost,
            cfg.model,
            clock,
            num_routed_dies=base.num_peers,
            use_int8=base.use_int8,
            tp=pd.tp,
            link=LinkModel.from_profile(load_profile(profile)),
            same_server=len(servers) == 1,
        )
        gather = TpGather(self.mem, layout, clock=clock, timeout_s=cfg.xccl.poll_timeout_s)
        return TpPrefillExecutor, {"gather": gather}

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> bool:
        """Take messages, move KV, agree, assign while requests are pending, prefill."""
        if self.loss.is_due(self.executor.num_iterations):
            self.loss.play(self.comm, self.executor.num_iterations, self.pricer.clock.now_ns / 1e9)
            self.is_stopped = True
            return False
        if self.heartbeat is not None:
            self.heartbeat.answer()  # from the event loop only: a stuck loop answers nothing
        if self.standby is not None:
            self.take_weights(wait=False)  # the scale-out's weights, when they are ordered
        self._take_messages()
        self.sender.tick(self.executor.num_iterations)
        self.sender.progress()  # step 8: completed sends free their blocks
        pending, active, outstanding, running = self._agree()
        if self.vtime is not None and not self.vtime.may_run:  # parked, or idle
            time.sleep(0.001)
            return bool(running or outstanding or active or pending)
        if self.vtime is not None:
            self.vtime.begin()  # at the TE's common virtual start
        if pending:
            active += self._assign()
        if active:
            if self.standby is not None:  # a standby pair's first prefill: its weights first
                self.take_weights(wait=True)
            self._iteration()
        elif not pending:
            time.sleep(0.001)
        return bool(running or outstanding or active or pending)

    def take_weights(self, *, wait: bool) -> None:
        """A standby pair's die: its weights pulled once the pair's JE passed on the scale-out
        (`wait`: before its first prefill, the order must come), then it serves as any die."""
        model = self.standby.take(wait=wait)
        if model is not None:
            self.executor.take_model(model)
            self.loaded, self.standby = self.standby, None

    def _take_messages(self) -> None:
        if self.vtime is not None:  # requests come inside the JE's grants, at virtual times
            num = len(self.pool)
            self.vtime.take_grants(self.pool, self.pooled_v)
            for req in list(self.pool)[num:]:
                if self.ems is not None:  # §4.3: the cost counts the hit (records only)
                    self.cached[req.req_id] = self.ems.probe(req)
        elif self.is_leader:
            while (msg := self.comm.improbe(source=SHELL, tag=TAG_REQUEST)) is not None:
                req = msg.recv()
                self.pool.append(req)
                self.pooled_v[req.req_id] = self.pricer.clock.now_ns / 1e9
                if self.ems is not None:  # §4.3: the cost counts the hit (records only)
                    self.cached[req.req_id] = self.ems.probe(req)
        if not self.is_stopped:
            msg = self.comm.improbe(source=SHELL, tag=TAG_STOP)
            if msg is not None:
                msg.recv()
                self.is_stopped = True
        self.sender.take_pulls()

    def _agree(self) -> tuple[int, int, int, int]:
        """(pending in the pool, requests on the dies, KV transfers outstanding, dies not yet
        told to stop), summed over the prefill dies: one allreduce."""
        mine = np.array(
            [
                len(self.pool),
                self.scheduler.num_active,
                self.sender.num_outstanding,
                0 if self.is_stopped else 1,
            ]
        )
        if self.vtime is not None:  # and the TE's clocks, horizons, grants, pool arrivals
            first = min((self.pooled_v[r.req_id] for r in self.pool), default=math.inf)
            return tuple(int(v) for v in self.vtime.agree(mine, first))
        total = np.empty_like(mine)
        self.group.Allreduce(mine, total, op=MPI.SUM)
        return tuple(int(v) for v in total)

    def _assign(self) -> int:
        """The leader gathers every group's status and hands out pending requests (only called
        while requests are pending); returns how many were assigned in all."""
        # Lazy import, as in _build: an idle prefill die (pd off) never assigns.
        from xds_mpi.pd.prefill import assign

        cfg = self.ctx.cfg
        statuses = self.group.gather(self.scheduler.status(cfg.pd.long_prompt_tokens), root=0)
        batches = None
        if self.is_leader:
            pool, later = list(self.pool), []
            if self.vtime is not None:  # the requests that arrived by the iteration's start
                pool = [r for r in self.pool if self.vtime.eligible(r.req_id, self.pooled_v)]
                later = [r for r in self.pool if not self.vtime.eligible(r.req_id, self.pooled_v)]
            batches, left = assign(
                pool,
                statuses[:: self.tp],  # one prefill DP group: its TP leader's status
                block_tokens=cfg.scheduler.kv_block_tokens,
                long_prompt_tokens=cfg.pd.long_prompt_tokens,
                step_tokens=cfg.xccl.max_tokens_per_die,
                cached=self.cached,
            )
            self.pool = deque(left + later)
            for r in (r for b in batches for r in b):
                self.cached.pop(r.req_id, None)
            num = sum(map(len, batches))
            groups = [
                Assignment(
                    requests=tuple(b),
                    pooled_v=tuple(self.pooled_v.pop(r.req_id) for r in b),
                    num_assigned=num,
                )
                for b in batches
            ]
            batches = [a for a in groups for _ in range(self.tp)]  # each die of a TP group
        mine: Assignment = self.group.scatter(batches, root=0)
        for req, pooled_v in zip(mine.requests, mine.pooled_v):
            # Pooled on the leader's clock: a die behind it idles until the request is there.
            self.pricer.clock.arrive(pooled_v * 1e9)
            if self.ems is not None:  # its cached prefix, written into its KV on admission
                self.ems.hold_prefix(req, self.scheduler, self.pricer)
            self.scheduler.add(req)
            self.assigned[req.req_id] = (time.time(), pooled_v)
        return mine.num_assigned

    def _iteration(self) -> None:
        start = (time.time(), self.pricer.clock.now_ns / 1e9)
        entries = self.scheduler.schedule()
        for e in entries:
            self.started.setdefault(e.req_id, start)
        sampled, _ = self.executor.forward(entries)
        if self.ems is not None:  # the prompts done: their computed full blocks to the pool
            for req_id in sampled:
                seq = self.scheduler.running[req_id]
                self.ems.put(seq.req, self.scheduler.table.slots(req_id))
        done = self.scheduler.postprocess(sampled)
        self.executor.commit({p.seq.req.req_id for p in done if p.is_finished})
        for prefilled in done:
            self._hand_over(prefilled)

    def _hand_over(self, prefilled) -> None:
        """Step 3: a finished prompt becomes a PD-transfer task the JE learns about (or, when
        its first token ends it, the token goes straight to the JE)."""
        req = prefilled.seq.req
        if not self.is_tp_leader:  # the group's leader hands it over; our KV copy is not needed
            self.assigned.pop(req.req_id)
            self.started.pop(req.req_id)
            self.executor.mtp.states.pop(req.req_id, None)
            if not prefilled.is_finished:
                self.scheduler.release(req)
            return
        if prefilled.is_finished:
            on_clock = {}  # virtual clock: when it was sampled and admitted
            if self.vtime is not None:
                on_clock = {
                    "vclock_s": self.pricer.clock.now_ns / 1e9,
                    "admitted_s": self.started[req.req_id][1],
                }
            batch = TokenBatch(
                die_rank=self.rank,
                iteration=self.executor.num_iterations,
                wall_time=time.time(),
                tokens=((req.req_id, prefilled.token, True),),
                **on_clock,
            )
            self.sends.append(self.comm.isend(batch, dest=SHELL, tag=TAG_TOKENS))
            self._sent_to_je()
            return
        task = self.sender.register(
            prefilled,
            self.executor.mtp.states.pop(req.req_id, None),
            assigned=self.assigned.pop(req.req_id),
            started=self.started.pop(req.req_id),
            now=(time.time(), self.pricer.clock.now_ns / 1e9),
        )
        self.sends.append(self.comm.isend(task, dest=SHELL, tag=TAG_PD_PREFILLED))
        self._sent_to_je()

    def _sent_to_je(self) -> None:
        """Virtual clock: the JE takes every message the TE sent before it decides."""
        if self.vtime is not None:
            self.vtime.num_sent += 1

    def close(self) -> None:
        """The report to the JE, then the collective frees."""
        timeout_s = self.ctx.cfg.xccl.poll_timeout_s  # the bound of every wait on the way out
        if self.heartbeat is not None:
            self.heartbeat.close(timeout_s=timeout_s)
        ems = self.ems.close() if self.ems is not None else {}
        if self.vtime is not None:
            self.vtime.drain(timeout_s)
        self.sends.append(self.sender.report(self.executor.num_iterations, ems=ems))
        # Tokens and prefilled tasks, then the report: the JE takes them all before its stop ends.
        wait_all(
            self.sends, timeout_s=timeout_s, me=f"die rank {self.rank}", event="messages to the JE"
        )
        if self.loaded is not None:
            self.loaded.drain()
        if not self.sender.failover.num_decode_failovers:  # collective: not after a failover
            self.mem.free()
        self.group.Free()
