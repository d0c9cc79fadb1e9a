"""Memory faults in expert slots, checked before launch (xds_mpi/plan/failures/checks.py): a slot
row runs when the slot's expert keeps a replica elsewhere once every slot row is masked
(ranks/recovery/memory.py); replicas come from health.replicas ring. Every other slot row is
refused, naming why. On an afd deployment (ranks/recovery/memory.py) a memory row, KV blocks or
slot, is refused beside a stuck/dead row."""

from __future__ import annotations

from xds_mpi.config.failures import FailureSpec
from xds_mpi.config.schema import Config
from xds_mpi.eplb.ring import ring_placement
from xds_mpi.plan.topology import Topology


def slot_refusal(cfg: Config, topo: Topology, where: str, spec: FailureSpec) -> str:
    """Why an expert-slot memory fault cannot run ("" when it can: ranks/recovery/memory.py masks
    the slot and the expert's other replica serves it; replicas come from health.replicas ring)."""
    slot = topo.ranks[spec.die].expert_slots[spec.slot]
    if slot.kind == "shared":
        return f"{where}: slot {spec.slot} of die {spec.die} holds shared expert " + (
            f"{slot.expert_idx}: a shared expert has no replica, so masking its slot would "
            "change every token"
        )
    others = [e for e in cfg.faults.events if e.kind in ("stuck", "dead")]
    if cfg.eplb.enabled or others:
        return (
            f"{where}: masking expert slot {spec.slot} of die {spec.die} beside stuck/dead rows "
            f"({len(others)}) or with eplb.enabled({cfg.eplb.enabled}) is refused: both install "
            "placements the mask does not edit; it would need the mask kept apart and applied "
            "to each new placement (a failover's without the lost dies, each EPLB version), and "
            "the failover's replica check (ranks/recovery/detector.py) to count masked slots "
            "as gone"
        )
    if slot.kind == "redundant" and _ring_expert(cfg, topo, slot.phy_idx) < 0:
        return (
            f"{where}: slot {spec.slot} of die {spec.die} is a redundant slot holding no expert "
            f"(health.replicas {cfg.health.replicas}): its fault would hit nothing served"
        )
    if cfg.health.replicas != "ring":
        return (
            f"{where}: slot {spec.slot} of die {spec.die} holds the only copy of routed expert "
            f"{slot.expert_idx} (health.replicas {cfg.health.replicas}): masking it would leave "
            "the expert nowhere"
        )
    return _masked_experts_left(cfg, topo, where)


def _ring_expert(cfg: Config, topo: Topology, phy: int) -> int:
    """The routed expert physical slot `phy` holds from the start (-1: none)."""
    if cfg.health.replicas != "ring":
        return -1  # redundant slots start empty (EPLB, which fills them, is refused above)

    return ring_placement(topo, 1).phy2log[0][phy]


def _masked_experts_left(cfg: Config, topo: Topology, where: str) -> str:
    """With every slot row masked, does each expert keep a replica in the ring placement?"""
    placement = ring_placement(topo, 1)
    masked = [
        topo.ranks[e.die].expert_slots[e.slot].phy_idx
        for e in cfg.faults.events
        if e.kind == "memory" and e.slot >= 0
    ]
    row = placement.phy2log[0]
    left = {x for s, x in enumerate(row) if x >= 0 and s not in masked}
    gone = sorted({x for x in row if x >= 0} - left)
    if gone:
        return (
            f"{where}: the masked expert slots (physical {sorted(masked)}) hold every replica "
            f"of routed expert(s) {gone}: masking them would leave those experts nowhere"
        )
    return ""


def afd_memory_refusal(cfg: Config, where: str, spec: FailureSpec) -> str:
    """Why a memory row cannot run on an afd deployment ("" when it can): not beside a stuck or
    dead row (ranks/recovery/scale_down.py). A masked slot: the TE-shell's check that a lost expert
    die leaves every expert a replica uses the start's placement, blind to the mask. KV blocks:
    the memory loss and a failover both take requests off a die, and which the TE-shell hears
    first is left to chance (a victim could be re-prefilled as an orphan). The refusals say
    what either would need."""
    others = [e for e in cfg.faults.events if e.kind in ("stuck", "dead")]
    if not others:
        return ""
    if spec.slot >= 0:
        what = f"slot {spec.slot}"
        why = (
            "the TE-shell would need to check a lost expert die's replicas against the "
            "placement without the masked slots (its check uses the start's placement)"
        )
    else:
        what = "KV blocks"
        why = (
            "the TE-shell would need to end a memory fault's victims before it re-prefills the "
            "lost die's requests (the two reach it in an order left to chance: a victim could "
            "be re-prefilled as an orphan)"
        )
    return (
        f"{where}: a memory fault ({what} of die {spec.die}) beside {len(others)} stuck/dead "
        f"row(s) in one afd run is refused: {why}"
    )
