"""Static replicas for vertical scaling (xDeepServe §6.2 stage 2: "each expert maintains at least
one replica"): with health.replicas "ring", routed die i's redundant slots hold copies of routed
die i+1's experts (mod the number of routed dies), in every MoE layer, from the start. Losing any
one die then leaves a replica of every expert. Token routing spreads over both copies
(xccl/routing.py), which changes where rows go, never what they compute: every die holds every
expert's weights (the model is built whole on each die). The dies load the weights
(ranks/colocated/replicas.py); the TE-shell and the validator need only the placement.
With EPLB (fixed=True) the ring's slots are fixed, not redundant: EPLB balances only the
redundant slots left over, and a lost die's experts keep their ring replica whatever it moves.
"""

from __future__ import annotations

from xds_mpi.eplb.placement import Placement, from_topology


def ring_placement(topo, num_moe_layers: int, *, fixed: bool = False) -> Placement:
    """The topology's placement with every redundant slot filled by the ring (at least as many
    redundant slots per die as routed experts on the next die: checked in
    xds_mpi/plan/failures/checks.py). fixed: the filled slots are no longer redundant (EPLB leaves
    them alone; a die computes them with the model's own weights)."""
    static = from_topology(topo, num_moe_layers)
    routed, row = static.phy2log[0], list(static.phy2log[0])
    dies = sorted({d for s, d in enumerate(static.slot_die) if not static.is_redundant[s]})
    for i, die in enumerate(dies):
        after = dies[(i + 1) % len(dies)]
        theirs = [
            e
            for s, e in enumerate(routed)
            if static.slot_die[s] == after and not static.is_redundant[s]
        ]
        for slot, expert in zip(static.redundant_slots(die), theirs):
            row[slot] = expert
    is_redundant = static.is_redundant
    if fixed:
        is_redundant = tuple(r and e < 0 for r, e in zip(is_redundant, row))
    return Placement(
        phy2log=(tuple(row),) * num_moe_layers,
        slot_die=static.slot_die,
        is_redundant=is_redundant,
        num_experts=static.num_experts,
    )
