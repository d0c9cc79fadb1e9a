"""Memory faults on the dies of disaggregated MoE-attention (xDeepServe §6.2 stage 3): the
colocated die's memory check (ranks/recovery/memory_check.py) with an afd die's iteration count and
slots.

  - An attention die holds the KV cache: a KV block row masks the blocks and ends the requests
    whose KV had a block there, as on a colocated die.
  - An expert die holds the expert slots: a slot row (its expert keeps a ring replica) turns the
    slot's weights to NaN on that die, and every die drops the slot from the placement: the
    attention dies route with it (their A2E), so the expert's other replica takes its rows.

Every die counts the busy iterations (AfdDieBase.iteration, the same on attention and expert dies,
idle domains included) and applies a row before the agreement of the iteration it names, so all
dies drop a slot at the same boundary.
"""

from __future__ import annotations

from ranks.recovery.memory_check import MemoryCheck
from xds_mpi.eplb.placement import Placement


def afd_memory_check(ctx) -> MemoryCheck:
    return MemoryCheck(ctx, site=AfdSlots())


class AfdSlots:
    """An afd die's placement (ranks/afd/common.py, one row for every MoE layer); an attention
    die routes with its log2phy, an expert die computes its slots' rows (ranks/afd/expert.py)."""

    @staticmethod
    def placement(die) -> Placement:
        return die.placement

    @staticmethod
    def install(die, placement: Placement) -> None:
        die.use_placement(placement)

    @staticmethod
    def corrupt(die, phy: int) -> None:
        """An expert die's slot `phy`: from now on it computes with a copy of its expert whose
        weights are NaN, in every MoE layer (the model is built whole on each die, and another
        slot of the die may hold the same expert: only this slot's copy goes bad)."""
        expert = die.placement.phy2log[0][phy]
        for layer_idx in die.plan.moe_layers:
            die.faulty[layer_idx, phy] = die.model.moe_of(layer_idx).experts[expert].broken()
