"""The virtual clock of disaggregated MoE-attention dies (xDeepServe §5.2), priced like the
colocated path (xds_mpi/execution/pricing.py) with the projection's A2E/E2A hops
(xds_mpi/projection/layers.py AfdHops).

An attention die's A2E is in flight while the die goes on with its next microbatch: its records
are stamped with the time they land at the expert dies (send time + A2E), the die's own clock is
left alone. The expert dies' clocks move to those stamps, run the experts (each tiny expert slot
stands for its share of the cost shape's experts per die) and stamp E2A; the attention die waits
for them (counted under E2A) and then pulls its outputs back (E2A's hops).
"""

from __future__ import annotations

from contextlib import contextmanager

from xds_mpi.execution.pricing import Pricer
from xds_mpi.projection.layers import AfdHops


class AfdPricer(Pricer):
    def __init__(self, *args, hops: AfdHops, num_routed_slots_here: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hops = hops
        self.experts_per_slot = self.experts_per_die / max(num_routed_slots_here, 1)
        self.calls: dict[str, list[float]] = {"A2E": [], "E2A": []}  # seconds per call

    @contextmanager
    def a2e_in_flight(self, rows: int):
        """Records published in the block land after the A2E; the die's clock is unchanged."""
        seconds = self.moe_scale * self.hops.a2e(self.cost, rows, int8=self.use_int8)
        self.calls["A2E"].append(seconds / self.moe_scale)
        self.spent[self._prefix + "A2E (overlapped)"] += seconds
        before = self.clock.snapshot()
        self.clock.advance(seconds * 1e9)
        try:
            yield
        finally:
            self.clock.restore(before)

    def e2a(self, rows: int) -> None:
        """After the wait for the expert dies: the outputs' way back to this die."""
        seconds = self.hops.e2a(self.cost, rows)
        self.calls["E2A"].append(seconds)
        self._add("E2A", self.moe_scale * seconds)

    def expert_slot(self, rows: int, *, is_shared: bool) -> None:
        """One tiny slot's rows of one call on an expert die."""
        if is_shared:
            seconds = self.cost.experts([rows] * self.cost.m.num_shared_experts)
        else:
            seconds = self.cost.routed(rows * self.topk_scale, self.experts_per_slot)
        self._add("experts", self.moe_scale * seconds)
