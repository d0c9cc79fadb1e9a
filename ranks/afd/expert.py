"""An expert die of disaggregated MoE-attention (xDeepServe §5.2, Figures 18-19): it hosts expert
slots (and, for attention group g, is its trampoline when it is expert die g). Each iteration it
learns from the dies' agreement which DP domains are busy, then runs the persistent loop
(xccl/afd/loop.py: receive A2E / compute / send E2A) over every MoE layer, domain and microbatch
of the iteration without coming back here in between. It ends when the attention dies do.

On the virtual clock (docs/virtual_time.md#afd) an expert die keeps its clock in step with the
attention dies': it brings its clock to the agreement (ranks/core/virtual_time.py `AgreedClock`)
and starts every iteration it runs at the common start, as they do. It takes no grant. A grant
carries requests and a horizon; an expert die holds no request, and its horizon would only
repeat the attention dies' (it brings inf, so the earliest horizon is theirs, and every die
learns from the same rows whether the iteration may start); an idle expert die warps with the
grant through the agreement: the attention dies' warped clocks are the common start of the next
iteration it runs. So the TE-shell grants and waits for the attention dies only. Held without a
grant to release it, an expert die waits for the parked attention dies in the next agreement,
and answers the TE-shell's heartbeats from that wait as they do from theirs. It serves the
iteration's calls one at a time (`_call_by_call`), so that its clock is the same whatever the
wall time."""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np

from ranks.afd.common import AfdDieBase
from ranks.afd.load_io import send_load
from ranks.core.context import RankContext
from ranks.core.handshake import handshake
from ranks.core.ready import report_ready
from ranks.core.trace_io import send_trace
from ranks.core.virtual_time import AgreedClock
from xccl.afd.loop import ExpertLoop, LoopStats
from xds_mpi.afd.load import ExpertLoad
from xds_mpi.report import trace


def run(ctx: RankContext) -> None:
    handshake(ctx)
    die = ExpertDie(ctx)
    report_ready(ctx.comm)
    while die.step():
        pass
    if die.is_lost:  # lost (ranks/core/decode_die.py): no collective
        die.leave()
        return
    ctx.log.debug(
        "expert die: %d iterations, %d calls, %d rows, %d metadata records",
        die.num_iterations,
        die.plan.num_calls,
        die.num_rows,
        die.afd.counters.metadata_writes,
    )
    die.recompute.report()  # collective: the dies' fault total
    send_trace(ctx.comm, timeout_s=ctx.cfg.xccl.poll_timeout_s)
    if not ctx.plan.pd:  # the TE-shell takes it (ranks/shell/frontend.py); PD's JE does not
        send_load(ctx.comm, die.load, timeout_s=ctx.cfg.xccl.poll_timeout_s)
    die.close()  # collective: only on the way out together (an error aborts the job)


class ExpertDie(AfdDieBase):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)

        self.loop = ExpertLoop(self.afd, self._compute, timeout_s=self.cfg.xccl.poll_timeout_s)
        self.layer_of: dict[int, int] = {}
        self.faulty: dict[tuple[int, int], object] = {}  # (layer, slot) -> NaN expert copy
        self.num_iterations = self.num_rows = 0
        self.load = self._expert_load()  # what each call brought (xds_mpi/afd/load.py)
        if ctx.plan.clock.is_virtual:  # no request, no grant: its horizon never holds back
            self.vtime = AgreedClock(self.clock, horizon_s=math.inf)

    def iterate(self) -> bool:
        if self.memory is not None:  # expert slots gone bad (ranks/recovery/memory.py)
            self.memory.check(self, self.iteration)
        busy, all_stopped = self.agree(0, False)  # which domains take turns now
        if not busy:  # agree backed off
            return not all_stopped
        if self.vtime is not None:
            self.vtime.begin()  # at the dies' common virtual start
            if self.falls_silent():  # an at_s dead row: silent from this iteration on
                return True
        stats = self.run_iteration(busy)
        self.num_iterations += 1
        self.num_rows += stats.num_rows
        return True

    def agreement_wait(self):
        """The fence; on the virtual clock also the heartbeats answered while the attention dies
        are parked for their grant, and the wait as long as theirs may be."""
        fence, timeout_s = self.agreement_fence()
        if self.vtime is None:
            return fence, timeout_s
        bound_s = max(timeout_s or 0.0, self.held_bound_s())
        health = self.health
        if health is None:
            return None, bound_s

        def answer_and_fence() -> None:
            health.answer()
            fence()

        return answer_and_fence, bound_s

    def attempt(self, busy, planned):
        """The expert dies' part of the iteration: every planned call, whatever the domain."""
        self.layer_of = {p.call.call: p.layer_idx for p in planned}
        self.load.begin(self.iteration)
        calls = [p.call for p in planned]
        with trace.span("expert loop", calls=len(planned)):
            if self.vtime is None:
                return self.loop.run(calls)  # persistent: every layer
            return self._call_by_call(calls)

    def _call_by_call(self, calls) -> LoopStats:
        """The virtual clock's loop: the calls one at a time, each through its stages in order
        (forward, receive, compute and send, return), so that this die's one clock prices the
        same steps in the same order whatever the wall time. The persistent loop takes a step
        of call k+1 (a trampoline's forward, a receive) as soon as its rows land in wall time,
        before or after call k's compute: its clock, and with it every die's, would depend on
        this machine's speed. Nothing waits on a later call, so no die waits for ever."""
        runs = [self.loop.run([call]) for call in calls]
        return LoopStats(
            num_calls=len(calls),
            num_rows=sum(r.num_rows for r in runs),
            num_turns=sum(r.num_turns for r in runs),
            num_overlapped=0,
            wall_s=sum(r.wall_s for r in runs),
        )

    def install(self, afd, routing) -> None:
        """A rebuilt A2E/E2A buffer, after a failover (ranks/recovery/scale_down.py): a loop on
        it; its own slots hold what they held (routing: the attention dies')."""
        self.loop = ExpertLoop(afd, self._compute, timeout_s=self.cfg.xccl.poll_timeout_s)

    def _compute(self, call, slot: int, rows: np.ndarray) -> np.ndarray:
        """One slot's rows of one call: a routed expert, or the shared experts."""
        layer_idx = self.layer_of[call.call]
        moe, is_routed = self.model.moe_of(layer_idx), slot < self.slots.num_routed_slots
        expert = self.placement.phy2log[0][slot] if is_routed else -1
        where = {"layer": layer_idx, "experts": [expert], "rows": [len(rows)]}
        with trace.span("experts", **where):
            x = rows.astype(self.model.dtype, copy=False)  # rows cross in the row dtype
            if (layer_idx, slot) in self.faulty:  # a memory fault (ranks/recovery/memory.py)
                out = self.faulty[layer_idx, slot](x)
            elif is_routed:
                out = moe.expert_forward(expert, x)
            else:
                out = moe.shared_forward(x)
            is_mtp = layer_idx >= len(self.model.layers)
            vstart_s = self.clock.now_ns / 1e9
            with self.pricer.mtp_layer() if is_mtp else nullcontext():
                self.pricer.expert_slot(len(rows), is_shared=not is_routed)
            self.load.add(
                iteration=self.iteration, call=call.call, layer=layer_idx, slot=slot,
                rows=len(rows), vstart_s=vstart_s, vend_s=self.clock.now_ns / 1e9,
                scale=1.0 if is_mtp else self.pricer.moe_scale,
            )  # fmt: skip
        return out

    def _expert_load(self):
        me, slots = self.world.rank, self.slots
        mine = tuple(s for s, owner in enumerate(slots.slot_owner) if owner == me)
        return ExpertLoad(
            rank=me,
            slots=mine,
            is_routed=tuple(slots.is_routed(s) for s in mine),
            topk_scale=self.pricer.topk_scale,
            experts_per_slot=self.pricer.experts_per_slot,
        )
