"""A die's virtual clock during an iteration: each piece of work the tiny model does is priced
at the cost shape (DeepSeek-V3) by the cost model, and XCCL's records carry the clock across dies.

The tiny model has fewer layers than the cost shape, so each emulated MoE (dense) layer stands for
cost_moe_layers / tiny_moe_layers (dense likewise) layers of the cost shape; its rows keep their
count, its top-k rows scale by cost top-k / tiny top-k, and a die's received rows spread over the
cost shape's experts per die. Waiting for the slowest die at dispatch and combine is counted
under those primitives, as a profiler on the die would see it.

What an iteration took on both clocks: the executor measures wall time per phase with one `Meter`
beside the virtual clock, and reports an `IterationTiming` (torch-free, so control-plane code can
carry it)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

from xccl.vclock import VirtualClock
from xds_mpi.config.schema import ModelConfig
from xds_mpi.projection.cost import CostModel
from xds_mpi.report import trace
from xds_mpi.scheduling.scheduler import Entry


class Pricer:
    def __init__(
        self,
        cost: CostModel,
        tiny: ModelConfig,
        clock: VirtualClock,
        *,
        num_routed_dies: int,
        use_int8: bool,
    ) -> None:
        big = cost.m
        self.cost, self.clock, self.use_int8 = cost, clock, use_int8
        tiny_moe = tiny.num_layers - tiny.num_dense_layers
        self.moe_scale = (big.num_layers - big.num_dense_layers) / tiny_moe
        self.dense_scale = big.num_dense_layers / max(tiny.num_dense_layers, 1)
        self.topk_scale = big.top_k / tiny.top_k
        self._priced: dict[tuple, float] = {}  # `_priced_once`'s, until `rescale`
        self.rescale(num_routed_dies)
        self.spent: dict[str, float] = defaultdict(float)  # operation -> virtual seconds
        # dispatch/combine slowed while an NPU-fork reads this die (xds_mpi/scaling/contention.py)
        self.link_factor = 1.0
        self._prefix = ""

    def rescale(self, num_routed_dies: int) -> None:
        """Price EP over `num_routed_dies` dies hosting routed experts (the cost shape's experts
        spread over them, dispatch/combine with as many peers): at start, and after vertical
        scaling left fewer (ranks/recovery/scale_down.py)."""
        self.experts_per_die = max(1, round(self.cost.m.num_routed_experts / num_routed_dies))
        self.num_peers = num_routed_dies
        self._priced.clear()

    @contextmanager
    def mtp_layer(self):
        """Price an MTP module's block: one MoE layer of the cost shape (not scaled by the layer
        ratio), its operations reported as "MTP <op>" (Figure 20's MTP forward)."""
        saved = self.moe_scale
        self.moe_scale, self._prefix = 1.0, "MTP "
        try:
            yield
        finally:
            self.moe_scale, self._prefix = saved, ""

    def _add(self, op: str, seconds: float) -> None:
        self.clock.advance(seconds * 1e9)
        self.spent[self._prefix + op] += seconds

    def pool_pull(self, seconds: float) -> None:
        """A prefix's KV pulled from the EMS pool (priced by the caller on its plane)."""
        self._add("ems pull", seconds)

    def waiting(self, op: str) -> _Waiting:
        """Count the virtual time the block's XCCL operation waited for its peers (the clock's
        arrivals) under `op`; nothing if it raised (its attempt is rolled back)."""
        return _Waiting(self, op)

    def snapshot(self) -> dict[str, float]:
        """Virtual seconds per operation so far (a copy), for `restore` and the die's report."""
        return dict(self.spent)

    def restore(self, snapshot: dict[str, float]) -> None:
        """Back to a `snapshot`: a failed attempt's priced operations forgotten."""
        self.spent = defaultdict(float, snapshot)

    def attention(self, entries: list[Entry], *, is_moe: bool) -> None:
        self.attention_rows(
            [(e.start_pos + len(e.input_ids), len(e.input_ids)) for e in entries], is_moe=is_moe
        )

    def _priced_once(self, key: tuple, price, *args, **kwargs) -> float:
        """price(*args, **kwargs), the cost model's seconds, computed once per `key` (the cost
        model is pure; a decode step prices the same few row counts each layer)."""
        seconds = self._priced.get(key)
        if seconds is None:
            seconds = self._priced[key] = price(*args, **kwargs)
        return seconds

    def attention_rows(self, seqs: list[tuple[int, int]], *, is_moe: bool) -> None:
        """seqs: (KV length, new rows) per sequence."""
        scale = self.moe_scale if is_moe else self.dense_scale
        rows = sum(num for _, num in seqs)
        self._add(
            "MLAProlog", scale * self._priced_once(("MLAProlog", rows), self.cost.mla_prolog, rows)
        )
        self._add("attention", scale * self.cost.attention(seqs))

    def dense_ffn(self, rows: int) -> None:
        self._add(
            "dense FFN",
            self.dense_scale * self._priced_once(("dense FFN", rows), self.cost.dense_ffn, rows),
        )

    def gate(self, rows: int) -> None:
        self._add("gate", self.moe_scale * self._priced_once(("gate", rows), self.cost.gate, rows))

    def dispatch(self, rows_in: int) -> None:
        seconds = self._priced_once(
            ("dispatch", rows_in),
            self.cost.dispatch,
            rows_in * self.topk_scale,
            peers=self.num_peers,
            int8=self.use_int8,
        )
        self._add("dispatch", self.moe_scale * seconds * self.link_factor)

    def experts(self, rows_in: int, rows: int) -> None:
        routed = self._priced_once(
            ("routed", rows_in), self.cost.routed, rows_in * self.topk_scale, self.experts_per_die
        )
        shared = self._priced_once(
            ("shared", rows), self.cost.experts, [rows] * self.cost.m.num_shared_experts
        )
        self._add("experts", self.moe_scale * (routed + shared))

    def combine(self, rows: int) -> None:
        seconds = self._priced_once(
            ("combine", rows), self.cost.combine, rows * self.cost.m.top_k, peers=self.num_peers
        )
        self._add("combine", self.moe_scale * seconds * self.link_factor)

    def mtp_projection(self, rows: int) -> None:
        """An MTP module's eh_proj over its block's rows (as xds_mpi/projection/project.py
        prices the MTP pass)."""
        self._add("eh_proj", self.cost.mtp_projection(rows))

    def mtp_head(self, rows: int) -> None:
        """An MTP pass's head and sampling; the pass is its own graph (CloudMatrix-Infer §4.2.4)."""
        self._add("head + sampling", self.cost.head(rows) + self.cost.sampling(rows))
        self._add("graph launch", self.cost.hw.graph_launch_s)

    def finish(self, num_sampled: int) -> None:
        self._add("head + sampling", self.cost.head(num_sampled) + self.cost.sampling(num_sampled))
        self._add("graph launch", self.cost.hw.graph_launch_s)  # the main pass's graph
        self._add("scheduling bubble", self.cost.hw.bubble_s)


@dataclass(frozen=True, kw_only=True)
class IterationTiming:
    """Wall seconds of one iteration on one die, by kind of work."""

    num_rows: int
    num_sampled: int  # entries that step (decode-only when rows = sampled + drafted)
    attention_s: float
    xccl_s: float  # dispatch + combine, waiting for peers included
    experts_s: float  # gate, routed experts, shared expert
    total_s: float
    vtime_s: float  # the same iteration on the 910C virtual clock
    num_tokens: int = 0  # tokens the step produced (accepted drafts included)
    num_drafted: int = 0  # MTP drafts verified
    num_accepted: int = 0  # MTP drafts accepted


class _Waiting:
    """`Pricer.waiting`'s block (a class: see _Metered)."""

    __slots__ = ("pricer", "op", "before_ns")

    def __init__(self, pricer: Pricer, op: str) -> None:
        self.pricer, self.op = pricer, op

    def __enter__(self) -> None:
        self.before_ns = self.pricer.clock.now_ns

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            pricer = self.pricer
            pricer.spent[pricer._prefix + self.op] += (pricer.clock.now_ns - self.before_ns) / 1e9


class Meter:
    """One iteration's clocks: wall seconds by kind of work (`with meter("xccl"): ...`), the wall
    time since the meter started, and the virtual time the die's clock advanced meanwhile.

    Kinds are those of IterationTiming: "attention", "xccl", "experts"; work outside every
    `with` (embedding, dense FFN, sampling) counts in the total only. With tracing on, each
    `with` is also a span (`name`, default the kind; xds_mpi/report/trace.py) from the same
    readings."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.started_s, self.vstart_ns = time.perf_counter(), clock.now_ns
        self.seconds: defaultdict[str, float] = defaultdict(float)  # kind -> wall seconds

    def __call__(self, kind: str, name: str = "", **args) -> _Metered:
        return _Metered(self, kind, name or kind, args)

    def total_s(self) -> float:
        return time.perf_counter() - self.started_s

    def vtime_s(self) -> float:
        return (self.clock.now_ns - self.vstart_ns) / 1e9


class _Metered:
    """One `with meter(...)`: a class, not @contextmanager (a generator and two `next` calls
    fewer; about 40 a die-iteration)."""

    __slots__ = ("meter", "kind", "name", "args", "started_s", "vstart_ns")

    def __init__(self, meter: Meter, kind: str, name: str, args: dict) -> None:
        self.meter, self.kind, self.name, self.args = meter, kind, name, args

    def __enter__(self) -> None:
        self.started_s, self.vstart_ns = time.perf_counter(), self.meter.clock.now_ns

    def __exit__(self, *exc) -> None:
        ended_s, meter = time.perf_counter(), self.meter
        meter.seconds[self.kind] += ended_s - self.started_s
        trace.record(
            self.name, (self.started_s, ended_s), (self.vstart_ns, meter.clock.now_ns), **self.args
        )


def iteration_timing(entries, sampled: dict[int, list[int]], meter: Meter) -> IterationTiming:
    """An executor's iteration as the die reports it: rows, samples, the meter's seconds per
    part, MTP drafts verified and accepted."""
    steps = [e for e in entries if e.is_sampled]
    spent = meter.seconds
    return IterationTiming(
        num_rows=sum(len(e.input_ids) for e in entries),
        num_sampled=len(steps),
        attention_s=spent["attention"],
        xccl_s=spent["xccl"],
        experts_s=spent["experts"],
        total_s=meter.total_s(),
        vtime_s=meter.vtime_s(),
        num_tokens=sum(len(t) for t in sampled.values()),
        num_drafted=sum(e.num_drafts for e in steps),
        num_accepted=sum(len(sampled[e.req_id]) - 1 for e in steps),
    )
