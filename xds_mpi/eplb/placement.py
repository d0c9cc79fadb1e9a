"""Where each MoE layer's logical experts live: one phy2log row per layer over the same physical
slots (routed slots fixed, redundant slots filled by EPLB), and what a placement implies.

A physical slot is the same place in every layer (die d's k-th redundant slot), but it may hold a
different logical expert in each layer: phy2log[layer][slot]. Pure functions, numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Expert placement of every EPLB-managed MoE layer.

    phy2log: [num_layers][num_slots] logical expert in each physical slot, -1 = empty/disabled.
    slot_die: [num_slots] die index (0-based, among the expert-hosting dies) owning the slot.
    is_redundant: [num_slots] True for redundant (replica) slots, False for routed ones.
    num_experts: logical routed experts per layer.
    """

    phy2log: tuple[tuple[int, ...], ...]
    slot_die: tuple[int, ...]
    is_redundant: tuple[bool, ...]
    num_experts: int

    @classmethod
    def static(
        cls, phy2log: tuple[int, ...], slot_die: tuple[int, ...], num_layers: int
    ) -> Placement:
        """Every layer as the topology places it: routed slots filled, redundant ones empty."""
        return cls(
            phy2log=(tuple(phy2log),) * num_layers,
            slot_die=tuple(slot_die),
            is_redundant=tuple(e < 0 for e in phy2log),
            num_experts=max(phy2log, default=-1) + 1,
        )

    @property
    def num_dies(self) -> int:
        return max(self.slot_die) + 1

    @property
    def live_dies(self) -> tuple[int, ...]:
        """The dies still serving: a die remove_die took out holds only fixed empty slots."""
        live = {
            die
            for slot, die in enumerate(self.slot_die)
            if self.is_redundant[slot] or any(row[slot] >= 0 for row in self.phy2log)
        }
        return tuple(sorted(live))

    def log2phy(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """[num_experts] physical slots holding each expert in `layer`, routed slot first."""
        table: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.phy2log[layer]):
            if expert >= 0:
                table[expert].append(slot)
        return tuple(tuple(slots) for slots in table)

    def redundant_slots(self, die: int) -> tuple[int, ...]:
        return tuple(s for s, d in enumerate(self.slot_die) if d == die and self.is_redundant[s])

    def with_layer(self, layer: int, row: tuple[int, ...]) -> Placement:
        rows = list(self.phy2log)
        rows[layer] = tuple(row)
        return Placement(
            phy2log=tuple(rows),
            slot_die=self.slot_die,
            is_redundant=self.is_redundant,
            num_experts=self.num_experts,
        )


def die_loads(placement: Placement, layer: int, counts: np.ndarray) -> np.ndarray:
    """Expected tokens per die when each expert's tokens split evenly over its replicas.

    counts: [num_experts] tokens per logical expert. Returns [num_dies] float64 over the live
    dies (every die but those remove_die took out)."""
    loads = np.zeros(placement.num_dies)
    for expert, slots in enumerate(placement.log2phy(layer)):
        for slot in slots:
            loads[placement.slot_die[slot]] += counts[expert] / len(slots)
    return loads[list(placement.live_dies)]


def changed_slots(old: Placement, new: Placement) -> tuple[tuple[int, int], ...]:
    """(layer, slot) of every redundant slot whose expert differs between two placements."""
    return tuple(
        (layer, slot)
        for layer, (a, b) in enumerate(zip(old.phy2log, new.phy2log))
        for slot, (x, y) in enumerate(zip(a, b))
        if old.is_redundant[slot] and x != y
    )


def disable(placement: Placement, slots: tuple[tuple[int, int], ...]) -> Placement:
    """The placement with the (layer, slot) pairs emptied: §4.5 Step 3 phase 2."""
    rows = [list(row) for row in placement.phy2log]
    for layer, slot in slots:
        rows[layer][slot] = -1
    return Placement(
        phy2log=tuple(tuple(r) for r in rows),
        slot_die=placement.slot_die,
        is_redundant=placement.is_redundant,
        num_experts=placement.num_experts,
    )


def remove_die(placement: Placement, die_idx: int) -> Placement:
    """Failover hook: the placement without die `die_idx`'s slots (routed and redundant). They
    become fixed and empty (-1 and not redundant): no rebalancing fills them again, and
    changed_slots never names them.

    Raises ValueError naming, per layer, every expert that would lose its last replica."""
    if not 0 <= die_idx < placement.num_dies:
        raise ValueError(f"die {die_idx} is not one of the {placement.num_dies} expert dies")
    gone = tuple(
        (layer, slot)
        for layer in range(len(placement.phy2log))
        for slot, die in enumerate(placement.slot_die)
        if die == die_idx
    )
    emptied = disable(placement, gone)
    result = Placement(
        phy2log=emptied.phy2log,
        slot_die=placement.slot_die,
        is_redundant=tuple(
            r and die != die_idx for r, die in zip(placement.is_redundant, placement.slot_die)
        ),
        num_experts=placement.num_experts,
    )
    lost = [
        f"layer {layer}: experts {missing}"
        for layer in range(len(result.phy2log))
        if (missing := [e for e, s in enumerate(result.log2phy(layer)) if not s])
    ]
    if lost:
        raise ValueError(
            f"removing die {die_idx} leaves no replica of: {'; '.join(lost)} "
            "(those experts live only on that die)"
        )
    return result


def from_topology(topo, num_layers: int) -> Placement:
    """The topology's static placement (redundant slots empty) for `num_layers` MoE layers;
    slot_die: the die index of the die owning each routed/redundant slot."""
    slot_die = [-1] * len(topo.phy2log)
    for info in topo.ranks:
        for slot in info.expert_slots:
            if slot.phy_idx >= 0:
                slot_die[slot.phy_idx] = info.die_idx
    return Placement.static(topo.phy2log, tuple(slot_die), num_layers)
