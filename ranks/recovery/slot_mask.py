"""A memory fault in an expert slot that has a replica elsewhere (xDeepServe §6.2 stage 3): the
slot is masked, the other replica serves its expert.

Every die, between iterations (ranks/recovery/memory_check.py): at a slot row's iteration the slot
leaves
the placement used for routing (eplb/placement.py `disable`, in every MoE layer), so no die sends
it rows again; its expert's other replicas take them. The row names a physical slot that every
die's routing knows, and every die runs the same iterations, so all dies drop it at the same
boundary: the emulator's stand-in for the runtime's memory check report reaching the peers
(detection is immediate, as for KV blocks). On the faulty die the slot's weights become garbage
(NaN) from then on: a row that still reached the slot would break the reference check.
The die owning the slot tells the TE-shell (SlotLoss), which keeps one FailureRecord per row.
The validator (xds_mpi/plan/failures.py) refuses a slot whose expert would keep no replica.

Where a die keeps the placement it routes with and its slots' weights is its `SlotSite`: a
colocated die's expert map (ColocatedSlots, here), an afd die's placement and an expert die's
slots (ranks/recovery/afd_memory.py AfdSlots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from xds_mpi.eplb.placement import Placement, disable
from xds_mpi.failures import FailureRecord


@dataclass(frozen=True, kw_only=True)
class SlotLoss:
    """Row `row`: die `die` masked its expert slot `slot` (physical slot `phy`, routed expert
    `expert`) at its iteration, wall time (time.time()) and virtual seconds; replicas: the
    physical slots still serving the expert (in the first MoE layer)."""

    row: int
    die: int
    slot: int
    phy: int
    expert: int
    replicas: tuple[int, ...]
    iteration: int
    wall: float
    virtual_s: float
    req_ids: tuple[int, ...] = ()  # no request loses anything: the TE-shell ends none

    @property
    def reason(self) -> str:
        return f"expert memory fault on die {self.die} slot {self.slot} (expert {self.expert})"


class SlotSite(Protocol):
    """Where a die keeps the placement it routes with and its expert slots' weights."""

    def placement(self, die) -> Placement: ...

    def install(self, die, placement: Placement) -> None: ...

    def corrupt(self, die, phy: int) -> None:
        """The die's own physical slot `phy`: its weights turn to NaN in every MoE layer."""


class ColocatedSlots:
    """A colocated die: its executor's expert map (ranks/colocated/replicas.py with ring
    replicas)."""

    @staticmethod
    def placement(die) -> Placement:
        return die.executor.expert_map.placement

    @staticmethod
    def install(die, placement: Placement) -> None:
        die.executor.expert_map.install(placement)

    @staticmethod
    def corrupt(die, phy: int) -> None:
        _corrupt(die, die.executor.expert_map, phy)


class SlotMask:
    """A die's side: every slot row of the run (all dies drop the slot), due at its iteration."""

    def __init__(self, ctx, site: SlotSite) -> None:
        self.rank, self.topo, self.site = ctx.comm.rank, ctx.topo, site
        self.rows = [
            (i, s)
            for i, s in enumerate(ctx.cfg.faults.events)
            if s.kind == "memory" and s.slot >= 0
        ]

    def check(self, die, iteration: int) -> list[SlotLoss]:
        """Between iterations (`iteration`: the die's count of them, the same on every die):
        mask the slots now due; the losses of this die's own slots."""
        losses, site = [], self.site
        for row, spec in [r for r in self.rows if iteration >= r[1].iteration]:
            self.rows.remove((row, spec))
            placement = site.placement(die)
            phy = self.topo.ranks[spec.die].expert_slots[spec.slot].phy_idx
            expert = placement.phy2log[0][phy]
            if spec.die == self.rank:
                site.corrupt(die, phy)
            layers = range(len(placement.phy2log))
            site.install(die, disable(placement, tuple((r, phy) for r in layers)))
            if spec.die != self.rank:
                continue
            losses.append(
                SlotLoss(
                    row=row,
                    die=self.rank,
                    slot=spec.slot,
                    phy=phy,
                    expert=expert,
                    replicas=site.placement(die).log2phy(0)[expert],
                    iteration=iteration,
                    wall=time.time(),
                    virtual_s=die.pricer.clock.now_ns / 1e9,
                )
            )
        return losses


def _corrupt(die, expert_map, phy: int) -> None:
    """The faulty memory: the slot's weights, in every MoE layer, turn to NaN."""
    placement = expert_map.placement
    for row, layer_idx in enumerate(expert_map.moe_layers):
        expert = placement.phy2log[row][phy]
        if placement.is_redundant[phy]:
            module = expert_map.weights[row, phy][1]
        else:
            module = die.executor.model.moe_of(layer_idx).experts[expert]
        module.break_in_place()


def slot_record(loss: SlotLoss, roles: dict, rate, started: float, ended: float) -> FailureRecord:
    """Found when injected, like a KV block fault; rate(a, b): served tokens/s over wall
    [a, b); started / ended: serving's wall start and end."""
    at = loss.wall - started
    return FailureRecord(
        kind="memory",
        die=loss.die,
        role=roles[loss.die],
        injected_iteration=loss.iteration,
        injected_wall_s=at,
        injected_virtual_s=loss.virtual_s,
        detected_wall_s=at,
        detected_virtual_s=loss.virtual_s,
        detected_by="memory check",
        verdict=f"faulty expert slot {loss.slot} (physical slot {loss.phy}, expert {loss.expert})",
        recovery=f"slot masked: expert {loss.expert} served by its replica at physical slot(s) "
        f"{list(loss.replicas)}; no request ended",
        tokens_per_s_before=rate(started, loss.wall),
        tokens_per_s_after=rate(loss.wall, ended),
    )
