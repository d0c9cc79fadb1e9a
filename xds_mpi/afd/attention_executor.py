"""Execution on an attention die of disaggregated MoE-attention (xDeepServe §5.2, Figure 19).

The die's batch is split into microbatches. Per layer and microbatch: finish the microbatch's MoE
of the previous layer (E2A), run its attention, and for a MoE layer gate it and issue its A2E,
which returns at once; then the next microbatch's attention runs while the expert dies work on
this one. In one Python process the overlap is real for the expert dies' time (compute, A2E'/E2A'
hops, other domains' turns): the attention die computes instead of waiting; it is not concurrent
on this die itself (no second stream). The shared expert runs on the expert dies (a column of
weight 1 summed last, as the reference's shared + routed); gate, attention, sampling are the
model's own pieces, as in the colocated executor. With MTP, each MTP module's block is one more
MoE layer of A2E/E2A calls after the main layers, its rows split into microbatches alike.
"""

from __future__ import annotations

import numpy as np

from xccl.afd.buffer import AfdBuffer
from xds_mpi.afd.plan import PlannedCall, split_counts, split_microbatches
from xds_mpi.execution.executor import ColocatedExecutor
from xds_mpi.execution.mtp import MtpWork
from xds_mpi.execution.pricing import IterationTiming, Meter, iteration_timing
from xds_mpi.scheduling.scheduler import Entry, Sampled


class AttentionExecutor(ColocatedExecutor):
    """Reuses the colocated executor's inputs and sampling; replaces its MoE by A2E/E2A."""

    def __init__(self, model, afd: AfdBuffer, *, num_microbatches: int, **kwargs) -> None:
        super().__init__(model, None, **kwargs)
        self.afd, self.num_microbatches = afd, num_microbatches

    def reroute(self, afd: AfdBuffer, log2phy, shared_slots: tuple[int, ...]) -> None:
        """A2E/E2A through `afd` with routing log2phy ([experts] -> physical slots) and the
        shared column to shared_slots from now on (after a failover or a masked slot,
        ranks/recovery/scale_down.py and memory.py)."""
        self.afd, self.log2phy, self.shared_slots = afd, log2phy, shared_slots

    def forward(
        self, entries: list[Entry], calls: list[PlannedCall]
    ) -> tuple[dict[int, Sampled], IterationTiming]:
        """Run the batch (possibly empty: the die still takes part in its domain's calls);
        `calls` are this domain's calls of the iteration, layer by layer, microbatch by
        microbatch. Returns what every sampled entry produced and the timing."""
        meter = Meter(self.clock)
        groups = split_microbatches(entries, self.num_microbatches)
        inputs = [self._inputs(group) for group in groups]  # (tokens, positions, chunks)
        pending = [None] * self.num_microbatches  # A2E handles in flight
        todo = self._todo = iter(calls)
        self.num_iterations += 1
        xs = [self.model.embed(tokens) for tokens, _, _ in inputs]  # [n_m, hidden] each
        for layer_idx, layer in enumerate(self.model.layers):
            for mb, (group, (tokens, positions, chunks)) in enumerate(zip(groups, inputs)):
                if pending[mb] is not None:  # previous layer's MoE
                    xs[mb] = xs[mb] + self._e2a(pending[mb], meter)
                    pending[mb] = None
                with meter("attention", layer=layer_idx, microbatch=mb):
                    if group:
                        xs[mb] = layer.attention_part(
                            xs[mb], positions, chunks, self.cache, layer_idx
                        )
                    self.pricer.attention(group, is_moe=layer.is_moe)
                if layer.is_moe:
                    planned = next(todo)
                    assert planned.layer_idx == layer_idx and planned.microbatch == mb
                    pending[mb] = self._a2e(layer, xs[mb], planned, meter)
                elif group:
                    xs[mb] = layer.ffn_part(xs[mb])
                    self.pricer.dense_ffn(len(tokens))
        for mb in range(self.num_microbatches):
            if pending[mb] is not None:
                xs[mb] = xs[mb] + self._e2a(pending[mb], meter)
        # The microbatches are contiguous groups of the batch.
        sampled, works = self._sample_and_draft(entries, np.concatenate(xs), meter)
        return self.results(sampled, works), iteration_timing(entries, sampled, meter)

    def _mtp_block(self, depth: int, active: list[MtpWork], inputs, meter: Meter) -> np.ndarray:
        """MTP module `depth`'s block: microbatch by microbatch, attention then A2E; then E2A."""
        block, layer_idx = self.model.mtp_module(depth).block, self.num_layers + depth - 1
        x, positions, chunks = self._mtp_rows(depth, active, inputs)
        self.pricer.mtp_projection(len(x))
        counts = [w.stop - w.start for w in active]
        pending, row, first = [], 0, 0
        for mb, num_works in enumerate(split_counts(counts, self.num_microbatches)):
            num_rows = sum(counts[first : first + num_works])
            xm = x[row : row + num_rows]
            with meter("attention", layer=layer_idx, microbatch=mb):
                if num_works:
                    xm = block.attention_part(
                        xm,
                        positions[row : row + num_rows],
                        chunks[first : first + num_works],
                        self.cache,
                        layer_idx,
                    )
                self.pricer.attention_rows(
                    [(w.stop, w.stop - w.start) for w in active[first : first + num_works]],
                    is_moe=True,
                )
            planned = next(self._todo)
            assert planned.layer_idx == layer_idx and planned.microbatch == mb
            pending.append((xm, self._a2e(block, xm, planned, meter)))
            row, first = row + num_rows, first + num_works
        return np.concatenate([xm + self._e2a(handle, meter) for xm, handle in pending])

    def _a2e(self, layer, x: np.ndarray, planned: PlannedCall, meter: Meter):
        """Gate the microbatch and send it toward its experts (returns without waiting)."""
        where = {"layer": planned.layer_idx, "microbatch": planned.microbatch}
        with meter("experts", "gate", **where):
            h = layer.ffn_norm(x)
            routing = layer.ffn.gate(h)
            self.pricer.gate(len(h))
        with meter("xccl", "dispatch", **where), self.pricer.a2e_in_flight(len(h)):
            return self.afd.a2e(
                h,
                routing.topk_idx,
                routing.topk_weight,
                planned.call,
                log2phy=self.log2phy,
                shared_slots=self.shared_slots,
            )

    def _e2a(self, handle, meter: Meter) -> np.ndarray:
        """Wait for the microbatch's expert outputs: [n, hidden] routed + shared."""
        with meter("xccl", "combine", event=handle.call.event_id):
            with self.pricer.waiting("E2A"):
                out = self.afd.e2a(handle)
            self.pricer.e2a(len(out))
            return out
