"""A disaggregated MoE-attention decode iteration priced the way its dies price it on the virtual
clock: the afd dies' `AfdPricer` (xds_mpi/afd/pricing.py) for each piece, put on the two dies'
clocks as they move (xds_mpi/afd/attention_executor.py, ranks/afd/expert.py).

The attention die, layer by layer, microbatch by microbatch (Figure 19): wait for the
microbatch's previous MoE (its E2A stamp from the expert dies, then E2A's hops), attention,
gate, and the A2E in flight: its rows land at the expert dies A2E later, the attention die goes
on with the next microbatch. The expert dies take the calls in order (MoE layer, DP domain,
microbatch: xds_mpi/afd/plan.py), each when its rows have landed and the previous call is done,
and run each expert slot a row reaches (`AfdPricer.expert_slot`: a fixed cost per slot, so how
many distinct experts a call reaches matters) and the shared expert; E2A is stamped at the end.
Then the head, and with MTP each MTP module's block as one more MoE layer.

Which rows an expert die receives: the tiny checkpoint's measured share of each expert
(routing_skew.py `EXPERT_SHARES`, an expert's rows Binomial over the call's tokens) where it
applies; otherwise (the cost shape at pod scale) the hottest expert die's rows of the uniform
multinomial (die_step.py `hottest_rows`), spread evenly over its slots. Every domain's
attention die is priced at the fullest batch, each on its own clock (the expert dies serve the
domains in turn), and the iteration ends with the last."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from xccl.vclock import VirtualClock
from xds_mpi.afd.pricing import AfdPricer
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config
from xds_mpi.execution.slots import ExpertSlots
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.topology import Topology
from xds_mpi.planning.die_step import hottest_rows
from xds_mpi.planning.routing_skew import expected_over_experts, measured_expert_shares
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.layers import AfdHops, counts


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """What an afd deployment's dies need to price an iteration, read once from its config."""

    cost: CostModel
    hops: AfdHops
    num_routed_dies: int
    slots_here: int  # routed slots on the expert die hosting the most
    num_expert_dies: int
    num_shared_dies: int  # dedicated shared-expert dies (0: a shared expert on every die)


@dataclass(frozen=True, kw_only=True)
class AfdStep:
    """One decode iteration of an afd deployment: `iteration_s(batch, kv_len)` with `batch`
    requests on the fullest attention die at mean KV length kv_len; accepted: MTP drafts
    accepted per request per step (the rows the MTP blocks run over)."""

    cfg: Config
    mtp_depth: int
    accepted: float

    @cached_property
    def _layout(self) -> _Layout:
        topo = Topology.from_config(self.cfg)
        slots = ExpertSlots.from_topology(topo)
        n = counts(self.cfg, topo)
        routed_owners = slots.slot_owner[: slots.num_routed_slots]
        hw = Hardware.from_profile(load_profile(self.cfg.hardware.profile))
        return _Layout(
            cost=CostModel(cost_shape(), hw, kv_int8=self.cfg.scheduler.kv_int8),
            hops=AfdHops.of(self.cfg, n),
            num_routed_dies=len(slots.routed_dies),
            slots_here=max(routed_owners.count(r) for r in slots.routed_dies),
            num_expert_dies=n["expert_dies"],
            num_shared_dies=n["shared_dies"],
        )

    def _pricer(self) -> AfdPricer:
        """A fresh pricer of the expert die hosting the most routed slots (its slots' share of
        the cost shape's experts); the attention die prices its pieces with the same cost model
        and hops."""
        layout = self._layout
        return AfdPricer(
            layout.cost,
            self.cfg.model,
            VirtualClock(),
            hops=layout.hops,
            num_routed_slots_here=layout.slots_here,
            num_routed_dies=layout.num_routed_dies,
            use_int8=self.cfg.xccl.use_int8,
        )

    def iteration_s(self, batch: int, kv_len: float) -> float:
        if batch <= 0:
            return 0.0
        dep, tiny = self.cfg.deployment, self.cfg.model
        pricer = self._pricer()
        timeline = _Timeline(pricer, self, num_domains=dep.num_dp_domains)
        rows_per_seq = 1 + self.mtp_depth  # the last token and the drafts to verify
        # start-up: xds_mpi/afd/plan.py imports xccl's AFD buffers and so mpi4py.MPI, which
        # would make the launcher (its parser imports the planner) an MPI singleton
        from xds_mpi.afd.plan import split_counts

        seqs = split_counts([rows_per_seq] * batch, dep.num_microbatches)  # requests per mb
        for layer_idx in range(tiny.num_layers):
            is_moe = layer_idx >= tiny.num_dense_layers
            moe_idx = layer_idx - tiny.num_dense_layers
            timeline.layer(seqs, rows_per_seq, kv_len, is_moe=is_moe, moe_idx=moe_idx)
        timeline.finish_moe()
        timeline.spend(pricer.finish, batch * rows_per_seq)
        mtp_rows_per_seq = 1 + self.accepted
        for _ in range(self.mtp_depth):  # `Executor._draft`: one pass per depth
            with pricer.mtp_layer():
                timeline.spend(pricer.mtp_projection, batch * mtp_rows_per_seq)
                timeline.layer(seqs, mtp_rows_per_seq, kv_len, is_moe=True, moe_idx=-1)
                timeline.finish_moe()
                timeline.spend(pricer.mtp_head, batch)
        return timeline.attention_s


class _Timeline:
    """Each DP domain's attention die (all at the fullest batch) and the hottest expert die, on
    their own clocks, one iteration; `attention_s`: the last domain's end."""

    def __init__(self, pricer: AfdPricer, step: AfdStep, *, num_domains: int) -> None:
        self.pricer, self.step = pricer, step
        self.domain_s = [0.0] * num_domains  # each domain's attention die's clock
        self.expert_s = 0.0
        # per domain: microbatch -> (its E2A stamp at the expert dies, its rows)
        self.pending: list[dict[int, tuple[float, float]]] = [{} for _ in range(num_domains)]
        self.shares = measured_expert_shares(step.cfg.model)

    @property
    def attention_s(self) -> float:
        return max(self.domain_s)

    def seconds(self, piece, *args, **kwargs) -> float:
        """piece(*args, **kwargs), a method of the pricer: its seconds."""
        before = self.pricer.clock.now_ns
        piece(*args, **kwargs)
        return (self.pricer.clock.now_ns - before) / 1e9

    def spend(self, piece, *args, **kwargs) -> None:
        """A piece every attention die runs on its own clock."""
        seconds = self.seconds(piece, *args, **kwargs)
        self.domain_s = [t + seconds for t in self.domain_s]

    def layer(self, seqs, rows_per_seq: float, kv_len: float, *, is_moe: bool, moe_idx: int):
        p = self.pricer
        calls = [[] for _ in self.domain_s]  # per domain: (landed at the experts, work, rows)
        for mb, num_seqs in enumerate(seqs):
            rows = num_seqs * rows_per_seq
            attended = [(kv_len + rows_per_seq, rows_per_seq)] * num_seqs
            own = self.seconds(p.attention_rows, attended, is_moe=is_moe)
            if is_moe:
                own += self.seconds(p.gate, rows)
                a2e = p.moe_scale * p.hops.a2e(p.cost, rows, int8=p.use_int8)
                work = self._expert_call_s(rows, moe_idx)
            else:
                own += self.seconds(p.dense_ffn, round(rows))
            for domain, domain_calls in enumerate(calls):
                self._wait_moe(domain, mb)
                self.domain_s[domain] += own
                if is_moe:
                    domain_calls.append((self.domain_s[domain] + a2e, work, rows))
        # the expert dies' turns: domain by domain, each its microbatches (xds_mpi/afd/plan.py)
        for domain, domain_calls in enumerate(calls):
            for mb, (landed, work, rows) in enumerate(domain_calls):
                self.expert_s = max(self.expert_s, landed) + work
                self.pending[domain][mb] = (self.expert_s, rows)

    def finish_moe(self) -> None:
        for domain, pending in enumerate(self.pending):
            for mb in sorted(pending):
                self._wait_moe(domain, mb)

    def _wait_moe(self, domain: int, mb: int) -> None:
        """The microbatch's previous MoE: its E2A stamp, then E2A's hops to this die."""
        if mb in self.pending[domain]:
            stamp, rows = self.pending[domain].pop(mb)
            waited = max(self.domain_s[domain], stamp)
            self.domain_s[domain] = waited + self.seconds(self.pricer.e2a, rows)

    def _expert_call_s(self, mb_rows: float, moe_idx: int) -> float:
        """The hottest expert die's routed slots and its shared expert over one domain's call."""
        cfg, p, layout = self.step.cfg, self.pricer, self.step._layout
        tokens = mb_rows * cfg.deployment.dp_groups_per_domain  # the domain's microbatch
        per_die = layout.num_routed_dies

        def slot_s(rows: float) -> float:
            before = p.clock.now_ns
            p.expert_slot(rows, is_shared=False)
            return (p.clock.now_ns - before) / 1e9

        if self.shares is not None:
            shares = self.shares[moe_idx]
            num_here = len(shares) // per_die
            routed = max(
                _interpolated(shares[d * num_here : (d + 1) * num_here], tokens, slot_s)
                for d in range(per_die)
            )
        else:
            here = layout.slots_here
            rows = hottest_rows(tokens * cfg.model.top_k, per_die)
            touched = here * (1 - (1 - 1 / here) ** rows) if here > 1 else 1.0
            routed = touched * slot_s(rows / touched) if rows > 0 else 0.0
        before = p.clock.now_ns
        p.expert_slot(tokens / (layout.num_shared_dies or layout.num_expert_dies), is_shared=True)
        shared = (p.clock.now_ns - before) / 1e9
        if layout.num_shared_dies:  # dedicated shared-expert dies run beside the routed ones
            return max(routed, shared)
        return routed + shared


def _interpolated(shares, tokens: float, slot_s) -> float:
    """expected_over_experts at a fractional token count, linear between the integers."""
    low = int(tokens)
    frac = tokens - low
    at_low = expected_over_experts(shares, low, slot_s)
    if frac == 0:
        return at_low
    return (1 - frac) * at_low + frac * expected_over_experts(shares, low + 1, slot_s)
