"""Where every physical expert slot lives: the slot ids XCCL dispatch/combine and A2E/E2A route
to, for both deployments (routed and redundant slots in phy_idx order, then the shared ones)."""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.plan.topology import Topology


@dataclass(frozen=True, kw_only=True)
class ExpertSlots:
    """Physical expert slots of a deployment: routed/redundant slots first (phy_idx order, so
    phy2log applies), then one shared-expert slot per die that holds a shared expert.
    slot_owner: [slots] rank hosting the slot. shared_slot_of: expert rank -> its shared slot."""

    slot_owner: tuple[int, ...]
    num_routed_slots: int
    shared_slot_of: dict

    @classmethod
    def from_topology(cls, topo: Topology) -> ExpertSlots:
        owner = [-1] * len(topo.phy2log)
        shared_ranks = []
        for info in topo.ranks:
            for slot in info.expert_slots:
                if slot.kind == "shared":
                    if info.rank not in shared_ranks:
                        shared_ranks.append(info.rank)
                else:
                    owner[slot.phy_idx] = info.rank
        num_routed = len(owner)
        return cls(
            slot_owner=tuple(owner + shared_ranks),
            num_routed_slots=num_routed,
            shared_slot_of={r: num_routed + i for i, r in enumerate(shared_ranks)},
        )

    @property
    def dedicated_shared_slots(self) -> tuple[int, ...]:
        """Every shared-expert slot: where a token's shared column goes with dedicated
        shared-expert dies (spread by token)."""
        return tuple(self.shared_slot_of.values())

    @property
    def routed_dies(self) -> frozenset[int]:
        """The ranks hosting routed slots: the EP size the cost model prices
        (ranks/core/die_parts.py
        make_pricer; after a loss, without the lost ranks: ranks/recovery/scale_down.py)."""
        return frozenset(int(rank) for rank in self.slot_owner[: self.num_routed_slots])

    def is_routed(self, slot: int) -> bool:
        return slot < self.num_routed_slots

    def shared_slots_for(self, trampoline: int, *, is_dedicated: bool) -> tuple[int, ...]:
        """Where an attention die's shared column goes: its trampoline's copy of the shared
        expert (every_die: no extra hop), or the dedicated shared dies, spread by token."""
        if not self.shared_slot_of:
            return ()
        if is_dedicated:
            return self.dedicated_shared_slots
        return (self.shared_slot_of[trampoline],)
