"""Disaggregated MoE-attention policy (xDeepServe §5.2, Figures 18-19): which calls an iteration
makes, how a die's batch splits into microbatches, where each expert slot lives. No compute here.

Order of the calls in an iteration (every die numbers them alike): MoE layer by layer; within a
layer the active DP domains take turns at the expert dies, domain by domain; within a domain its
microbatches in order. A domain with no requests anywhere takes no calls: the expert dies serve the
busy domains back to back. Lane = domain x num_microbatches + microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from xccl.afd.buffer import AfdCall
from xds_mpi.scheduling.scheduler import Entry


@dataclass(frozen=True, kw_only=True)
class PlannedCall:
    call: AfdCall
    layer_idx: int
    microbatch: int


class AfdPlan:
    """Event id = iteration x M + (MoE layer position x domains + domain) x microbatches +
    microbatch, M = calls of an iteration with every domain busy: a re-executed iteration
    (token recomputation) has the same event ids, while its call numbers (doorbells) are new."""

    def __init__(
        self, *, moe_layers: tuple[int, ...], num_domains: int, num_microbatches: int
    ) -> None:
        self.moe_layers, self.num_domains = moe_layers, num_domains
        self.num_microbatches = num_microbatches
        self.events_per_iteration = len(moe_layers) * num_domains * num_microbatches
        self.num_calls = 0  # calls numbered so far, on every die

    def iteration(self, busy_domains: tuple[int, ...], iteration: int = 0) -> list[PlannedCall]:
        """This iteration's calls; advances the call numbering."""
        planned = []
        for position, layer_idx in enumerate(self.moe_layers):
            for domain in busy_domains:
                for mb in range(self.num_microbatches):
                    lane = domain * self.num_microbatches + mb
                    event = (
                        iteration * self.events_per_iteration
                        + (position * self.num_domains + domain) * self.num_microbatches
                        + mb
                    )
                    call = AfdCall(call=self.num_calls, lane=lane, domain=domain, event_id=event)
                    planned.append(PlannedCall(call=call, layer_idx=layer_idx, microbatch=mb))
                    self.num_calls += 1
        return planned

    def renumber(self, num_calls: int) -> None:
        """Number the next calls from `num_calls` on (after a failover every survivor takes the
        highest count among them, so that they number the next calls alike)."""
        self.num_calls = num_calls

    def layer_of_event(self, event_id: int) -> int:
        position = (event_id % self.events_per_iteration) // (
            self.num_domains * self.num_microbatches
        )
        return self.moe_layers[position]


def split_microbatches(entries: list[Entry], num_microbatches: int) -> list[list[Entry]]:
    """Contiguous groups of entries with about the same number of rows (some may be empty)."""
    sizes = split_counts([len(e.input_ids) for e in entries], num_microbatches)
    groups, first = [], 0
    for size in sizes:
        groups.append(entries[first : first + size])
        first += size
    return groups


def split_counts(counts: list[int], num_groups: int) -> list[int]:
    """How many consecutive items (of `counts` rows each) go to each of `num_groups` groups so
    the groups hold about the same number of rows (some may be empty)."""
    total = sum(counts)
    sizes = [0] * num_groups
    before = 0
    for count in counts:
        sizes[min(num_groups - 1, before * num_groups // max(total, 1))] += 1
        before += count
    return sizes
