"""The colocated two-stream decode (CloudMatrix-Infer §4.2.3, Figure 14b): the die's batch split
into two microbatches, stream 0 running attention (MLAProlog, attention) and stream 1 the MoE
path (gate, dispatch, experts, combine, shared expert), so one microbatch's dispatch and combine
overlap the other's attention.

The streams are interleaved steps of one process; the XCCL calls are split into issue (stage and
publish, xccl/ep/buffer.py `issue_dispatch`) and wait, each microbatch on its own EP lane (its
own records and staging: xccl/moe_layout.py `num_lanes`). Per MoE layer, A and B the two
microbatches, every die makes the same calls in this order:

    1. s0  attention(A)
    2. s1  gate(A), issue dispatch(A)
    3. s1  wait combine(B) of the previous MoE layer, + shared expert(B)   [overlapped 1]
    4. s0  attention(B)                                                    [overlaps A's dispatch]
    5. s1  wait dispatch(A), experts(A), issue combine(A)
    6. s1  gate(B), issue dispatch(B)
    7. s1  wait combine(A), + shared expert(A)
    8. s1  wait dispatch(B), experts(B), issue combine(B)                 [waited at 3 next layer]

Why this order: §4.2.3 puts attention on stream 0 and the whole MoE path on stream 1, so while
stream 1 moves A through dispatch / experts / combine, stream 0 computes B's attention (steps
2-5), and B's combine is in flight while stream 0 starts the next layer with A (steps 8, 1, 3).
A wait is placed as late as the data allows: each microbatch's next stage needs its own result
and nothing else. It cannot deadlock: every wait waits for peers' issues that come before it in
the same order on every die. A lane never restages before its previous call was waited for
(issue dispatch after wait combine, issue combine after wait dispatch), which is what the EP
buffer's no-acks argument needs, lane by lane.

Virtual time: each stream has its own time and so has each microbatch (its data); a step starts
at the later of its stream's and its microbatch's time, and the die's clock is the later stream
at the end. In steady state a layer therefore takes 2 x the longer stream, the projection's rule
(xds_mpi/projection/layers.py `colocated_layer`); the fill and drain of the pipeline and the
waits for peers are what the emulated clock adds. Stream 0 is priced on 2/3 of the die's cube
and vector cores and stream 1 on the rest (§4.2.3's 16 + 8 AIC of 24), as the projection's
split (`split_streams`).

Token-exact: the split is by entries, every row sees the same operations as in one batch (the
model's matmuls are batch-invariant, xds_mpi/model/layers.py), and each token's combine sums its
columns in column order whatever lane carried it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from xccl.vclock import VirtualClock
from xds_mpi.execution.pricing import Meter
from xds_mpi.scheduling.scheduler import Entry

STREAM0_AIC_SHARE = 2 / 3  # §4.2.3: stream 0 on 16 of 24 AIC (and 32 of 48 AIV)


def split_cores(cost):
    """(stream 0's, stream 1's) cost model: §4.2.3's core split, as the projection prices it."""
    # start-up: the projection's layer model only in a two-stream die (docs/design.md, Layers)
    from xds_mpi.projection.layers import split_streams

    return split_streams(cost, round(cost.hw.aic_cores * STREAM0_AIC_SHARE))


class Streams:
    """Two streams' virtual times on one die's clock, and each microbatch's."""

    def __init__(self, clock: VirtualClock) -> None:
        now = clock.now_ns
        self.clock = clock
        self.free = [now, now]  # stream -> when it is free
        self.ready = [now, now]  # microbatch -> when its last step ended

    @contextmanager
    def on(self, stream: int, micro: int):
        """Run a step of microbatch `micro` on `stream`: the clock shows when it can start."""
        self.clock.show(max(self.free[stream], self.ready[micro]))
        yield
        self.free[stream] = self.ready[micro] = self.clock.now_ns

    def join(self) -> None:
        """Both streams done: the die's clock at the later one."""
        self.clock.show(max(self.free))


@dataclass
class Micro:
    """One microbatch's rows through the layers, and its MoE call in flight."""

    index: int
    entries: list[Entry]
    x: np.ndarray
    positions: np.ndarray
    chunks: list
    h: np.ndarray | None = None  # the MoE layer's normalized input
    moe: object = None
    topk_idx: np.ndarray | None = None
    sent: object = None  # SentDispatch or SentCombine in flight
    layer_idx: int = -1


def split_entries(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """Two microbatches of whole entries, in order, their rows as even as the entries allow."""
    rows = np.cumsum([len(e.input_ids) for e in entries])
    total = int(rows[-1]) if len(rows) else 0
    cut = int(np.argmin(np.abs(2 * np.concatenate([[0], rows]) - total)))
    return entries[:cut], entries[cut:]


class TwoStreamPass:
    """The main layers of one iteration on a ColocatedExecutor with two EP lanes."""

    def __init__(self, executor, meter: Meter, stream_costs) -> None:
        self.ex, self.meter = executor, meter
        self.pricer = executor.pricer
        self.stream_costs = stream_costs  # (stream 0's, stream 1's) cost model
        self.streams = Streams(executor.clock)

    @contextmanager
    def on(self, stream: int, m: Micro):
        full = self.pricer.cost
        self.pricer.cost = self.stream_costs[stream]
        try:
            with self.streams.on(stream, m.index):
                yield
        finally:
            self.pricer.cost = full

    def run(self, entries: list[Entry]) -> np.ndarray:
        """The main layers over `entries`: the last layer's rows [n, hidden] in entry order."""
        ex = self.ex
        micro = []
        for i, half in enumerate(split_entries(entries)):
            tokens, positions, chunks = ex._inputs(half)
            rows = ex._own_rows(len(tokens))  # all of them but on a prefill TP group's die
            micro.append(Micro(i, half, ex.model.embed(tokens[rows]), positions, chunks))
        a, b = micro
        for layer_idx, layer in enumerate(ex.model.layers):
            self.attend(a, layer, layer_idx)  # 1
            if not layer.is_moe:
                self.dense(a, layer)
                self.finish(b)
                self.attend(b, layer, layer_idx)
                self.dense(b, layer)
                continue
            self.issue_dispatch(a, layer.ffn, layer.ffn_norm(a.x), layer_idx)  # 2
            self.finish(b)  # 3
            self.attend(b, layer, layer_idx)  # 4
            self.experts(a)  # 5
            self.issue_dispatch(b, layer.ffn, layer.ffn_norm(b.x), layer_idx)  # 6
            self.finish(a)  # 7
            self.experts(b)  # 8
        self.finish(b)
        self.streams.join()
        layer_idx = len(ex.model.layers) - 1
        return np.concatenate([ex._all_rows(m.x, len(m.positions), layer_idx, self.meter)
                               for m in (a, b)])  # fmt: skip

    # -- steps ----------------------------------------------------------------------------------
    def attend(self, m: Micro, layer, layer_idx: int) -> None:
        with self.on(0, m), self.meter("attention", layer=layer_idx, microbatch=m.index):
            seqs = [(e.start_pos + len(e.input_ids), len(e.input_ids)) for e in m.entries]
            m.x = self.ex._attend(layer, m.x, m.positions, m.chunks, seqs, layer_idx)

    def dense(self, m: Micro, layer) -> None:
        with self.on(0, m):
            if m.entries:
                m.x = layer.ffn_part(m.x)
                self.pricer.dense_ffn(len(m.x))

    def issue_dispatch(self, m: Micro, moe, h: np.ndarray, layer_idx: int) -> None:
        ex, pricer = self.ex, self.pricer
        m.h, m.moe, m.layer_idx = h, moe, layer_idx
        with self.on(1, m):
            with self.meter("experts", "gate", layer=layer_idx, microbatch=m.index):
                routing = moe.gate(h)
                pricer.gate(len(h))
            m.topk_idx = routing.topk_idx
            with self.meter("xccl", "dispatch issue", layer=layer_idx, microbatch=m.index):
                m.sent = ex.lanes[m.index].issue_dispatch(
                    h,
                    routing.topk_idx,
                    routing.topk_weight,
                    ex.events.event_id(ex.num_iterations, layer_idx),
                    log2phy=ex.expert_map.log2phy(layer_idx),
                    shared_slots=ex.shared_slots,
                )

    def experts(self, m: Micro) -> None:
        """Wait for m's dispatch, run this die's experts over what came, issue the combine."""
        ex, pricer, layer_idx, lane = self.ex, self.pricer, m.layer_idx, self.ex.lanes[m.index]
        with self.on(1, m):
            with self.meter("xccl", "dispatch", layer=layer_idx, microbatch=m.index):
                with pricer.waiting("dispatch"):
                    recv_x, info, handle = lane.wait_dispatch(m.sent)
                pricer.dispatch(len(recv_x))
            ex.expert_map.collect(layer_idx, m.topk_idx, len(recv_x))
            with self.meter("experts", layer=layer_idx, **ex._load(info, layer_idx)):
                expert_out = ex._experts(m.moe, recv_x, info, layer_idx)
                pricer.experts(len(recv_x), 0 if ex.shared_slots else len(m.h))
            with self.meter("xccl", "combine issue", layer=layer_idx, microbatch=m.index):
                m.sent = lane.issue_combine(expert_out, handle)

    def finish(self, m: Micro) -> None:
        """Wait for m's combine in flight (if any) and add the MoE output to its rows."""
        if m.sent is None:
            return
        ex, pricer, layer_idx = self.ex, self.pricer, m.layer_idx
        with self.on(1, m):
            with self.meter("xccl", "combine", layer=layer_idx, microbatch=m.index):
                with pricer.waiting("combine"):
                    routed = ex.lanes[m.index].wait_combine(m.sent)
                pricer.combine(len(m.h))
            with self.meter("experts", layer=layer_idx, shared=True, microbatch=m.index):
                shared = 0.0 if ex.shared_slots else m.moe.shared_forward(m.h)
        m.x = m.x + (shared + routed)
        m.sent = None
