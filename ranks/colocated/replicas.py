"""A die's expert map with the ring's replicas (xds_mpi/eplb/ring.py) and their weights."""

from __future__ import annotations

from xds_mpi.eplb.expert_map import ExpertMap
from xds_mpi.eplb.ring import ring_placement


def ring_expert_map(topo, model, moe_layers: tuple[int, ...], *, fixed: bool = False):
    """A die's expert map with the ring's replicas in, their weights loaded from the model
    (fixed, with EPLB: the ring's slots are not redundant and compute with the model's own
    weights, xds_mpi/eplb/ring.py)."""
    expert_map = ExpertMap(ring_placement(topo, len(moe_layers), fixed=fixed), moe_layers)
    placement = expert_map.placement
    for row, layer_idx in enumerate(moe_layers):
        moe = model.moe_of(layer_idx)
        for slot, expert in enumerate(placement.phy2log[row]):
            if placement.is_redundant[slot] and expert >= 0:
                expert_map.load(row, slot, expert, moe.experts[expert])
    return expert_map
