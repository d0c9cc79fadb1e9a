"""An attention die of disaggregated MoE-attention (xDeepServe §5.2, Figures 18-19): one DP group
(TP=1) of a DP domain. Each iteration the dies agree which domains have work; a busy domain's dies
run attention on their own requests and meet the expert dies through A2E/E2A at every MoE layer,
microbatch by microbatch, even with nothing to send; an idle domain sits the iteration out.

On the virtual clock (docs/virtual_time.md#afd) an attention die takes its requests in the
TE-shell's grants and keeps the colocated dies' rule (ranks/core/virtual_time.py
`DieVirtualTime`): its clock and horizon in the agreement, every iteration started at the common
start (an idle domain's dies too, so that their clocks follow the busy ones), none started at or
past the horizon; parked there, it reports once per grant and waits for the next grant out of
the agreement, answering heartbeats."""

from __future__ import annotations

from ranks.afd.common import AfdDieBase
from ranks.core.context import RankContext
from ranks.core.die_io import DieTotals, Inbox, Outbox, serve
from ranks.core.die_parts import decode_state, decode_totals
from ranks.core.handshake import handshake
from ranks.core.virtual_time import DieVirtualTime
from xds_mpi.execution.pricing import IterationTiming

IDLE = IterationTiming(
    num_rows=0, num_sampled=0, attention_s=0.0, xccl_s=0.0, experts_s=0.0, total_s=0.0, vtime_s=0.0
)


def run(ctx: RankContext) -> None:
    handshake(ctx)
    serve(AttentionDie(ctx))


class AttentionDie(AfdDieBase):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        # Lazy import: PD colocated decode dies import this module, never build it (docs/scale.md).
        from xds_mpi.afd.attention_executor import AttentionExecutor

        cfg, topo = self.cfg, self.topo
        state = decode_state(cfg, self.model)
        self.domain = ctx.info.dp_domain
        self.scheduler = state.scheduler
        shared_slots = self.slots.shared_slots_for(
            topo.trampoline_rank(ctx.comm.rank),
            is_dedicated=cfg.deployment.shared_experts == "dedicated",
        )
        self.executor = AttentionExecutor(
            self.model,
            self.afd,
            slots=self.slots,
            shared_slots=shared_slots,
            num_microbatches=cfg.deployment.num_microbatches,
            phy2log=self.placement.phy2log[0],
            log2phy=self.placement.log2phy(0),
            table=state.table,
            cache=state.cache,
            pricer=self.pricer,
            mtp_depth=cfg.scheduler.mtp_depth,
        )
        self.inbox = Inbox(ctx.comm, self.scheduler)
        if ctx.plan.clock.is_virtual:
            self.vtime = DieVirtualTime(
                ctx.comm,
                self.clock,
                self.scheduler,
                timeout_s=self.held_bound_s(),
                **self.granted_by(ctx),
            )
        self.outbox = Outbox(
            ctx.comm,
            ctx.comm.rank,
            timeout_s=cfg.xccl.poll_timeout_s,
            clock=self.clock if self.vtime is not None else None,
        )

    def iterate(self) -> bool:
        """One iteration, as Figure 19: policy (scheduler, plan) and execution apart."""
        self.inbox.poll()  # requests / stop from the TE-shell
        vtime = self.vtime
        if vtime is not None:
            vtime.take_grants()  # requests and the horizon (virtual time)
            if vtime.is_held(self.inbox.is_stopped):  # parked: out of the agreement
                self.agreement_fence()  # a fence still releases it (decode_die.py)
                return True
        if self.memory is not None:  # KV blocks and expert slots gone bad
            self.memory.check(self, self.iteration)
        self.before_agree()
        busy, all_stopped = self.agree(self.scheduler.num_active, not self.inbox.is_stopped)
        if vtime is not None:  # where this die stands, to the TE-shell; held until its grant?
            vtime.after_agree(bool(busy), self.news_sent())
        if not busy:  # agree backed off, or parked at the horizon
            return not all_stopped
        if vtime is not None:
            vtime.begin()  # at the dies' common virtual start
            if self.falls_silent():  # an at_s dead row: silent from this iteration on
                return True
        result = self.run_iteration(busy, state=(self.scheduler, self.executor))
        if result is None:  # the other domains took their turn
            self.outbox.stream([], IDLE)  # one row per iteration
            return True
        sampled, timing = result
        emitted = self.scheduler.postprocess(sampled)
        if vtime is not None:
            vtime.end()  # the requests this iteration admitted, at its start
        finished = {e.req_id for e in emitted if e.is_finished}
        self.executor.commit(finished | self.inbox.take_cancelled())
        self.emit(emitted, timing)  # the output shortcut
        return True

    def granted_by(self, ctx: RankContext) -> dict:
        """Who grants this die its requests on the virtual clock, and what they become here
        (DieVirtualTime's defaults: the TE-shell, the scheduler's waiting queue)."""
        return {}

    def news_sent(self) -> int:
        """Messages the granting shell takes before it decides: the token batches."""
        return self.outbox.num_batches

    def before_agree(self) -> None:
        """Work between iterations before the dies agree (PD: KV transfers, ranks/pd/decode.py)."""

    def emit(self, emitted, timing) -> None:
        """Stream the iteration's tokens to the TE-shell (PD adds the prefill's first tokens)."""
        self.outbox.stream(emitted, timing)

    def attempt(self, busy, planned):
        """Schedule and run this die's part of the iteration (None when its domain is idle)."""
        if self.domain not in busy:
            return None
        entries = self.scheduler.schedule()  # continuous batching, chunked prefill
        mine = [c for c in planned if c.call.domain == self.domain]
        return self.executor.forward(entries, mine)  # attention, A2E ... E2A

    def skip_iterations(self, num: int) -> None:
        """One idle row per iteration number skipped, like an idle domain's (one row per
        iteration on every die: the TE-shell lines the dies' rows up)."""
        for _ in range(num):
            self.outbox.stream([], IDLE)

    def install(self, afd, routing) -> None:
        """A rebuilt A2E/E2A buffer and routing, after a failover
        (ranks/recovery/scale_down.py)."""
        self.executor.reroute(afd, routing.log2phy, routing.shared_slots)

    def use_placement(self, placement) -> None:
        """Who hosts which expert from now on; routed with it at once."""
        super().use_placement(placement)
        executor = self.executor
        executor.reroute(self.afd, placement.log2phy(0), executor.shared_slots)

    def num_batches_sent(self) -> int:
        return self.outbox.num_batches

    def drain(self) -> None:
        self.outbox.drain()
        if self.vtime is not None:
            self.vtime.drain()

    def totals(self) -> DieTotals:
        return decode_totals(self.executor, self.pricer, self.recompute, self.scheduler)
