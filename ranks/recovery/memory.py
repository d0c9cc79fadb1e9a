"""On-chip memory faults in a die's KV cache (xDeepServe §6.2 stage 3), both ends.

The die (`MemoryCheck`, called between iterations; a colocated die, or an afd attention die:
ranks/recovery/memory.py): when it reaches a `memory` row's iteration, its runtime reports KV
blocks [first_block, first_block + num_blocks) faulty (the emulator's stand-in for the CANN
runtime's memory check: reported at once). The die masks them (never
handed out again, the pool shrinks) and ends every request whose KV had a block there: its KV
is gone, so it leaves the batch with a reason and its other blocks go back. The rest continue
untouched. The die tells the TE-shell (MemoryLoss).

The TE-shell (`MemoryLosses`, polled from its loop): each named request ends with its reason
(recorded in the run file, skipped by name by `--check` and counted apart), and one
FailureRecord per row.

A memory fault in an expert slot that has a replica elsewhere (xDeepServe §6.2 stage 3): the
slot is masked, the other replica serves its expert.

Every die, between iterations (ranks/recovery/memory.py): at a slot row's iteration the slot leaves
the placement used for routing (eplb/placement.py `disable`, in every MoE layer), so no die sends
it rows again; its expert's other replicas take them. The row names a physical slot that every
die's routing knows, and every die runs the same iterations, so all dies drop it at the same
boundary: the emulator's stand-in for the runtime's memory check report reaching the peers
(detection is immediate, as for KV blocks). On the faulty die the slot's weights become garbage
(NaN) from then on: a row that still reached the slot would break the reference check.
The die owning the slot tells the TE-shell (SlotLoss), which keeps one FailureRecord per row.
The validator (xds_mpi/plan/failures/checks.py) refuses a slot whose expert would keep no replica.

Where a die keeps the placement it routes with and its slots' weights is its `SlotSite`: a
colocated die's expert map (ColocatedSlots, here), an afd die's placement and an expert die's
slots (ranks/recovery/memory.py AfdSlots).

Memory faults on the dies of disaggregated MoE-attention (xDeepServe §6.2 stage 3): the
colocated die's memory check (ranks/recovery/memory.py) with an afd die's iteration count and slots.

  - An attention die holds the KV cache: a KV block row masks the blocks and ends the requests
    whose KV had a block there, as on a colocated die.
  - An expert die holds the expert slots: a slot row (its expert keeps a ring replica) turns the
    slot's weights to NaN on that die, and every die drops the slot from the placement: the
    attention dies route with it (their A2E), so the expert's other replica takes its rows.

Every die counts the busy iterations (AfdDieBase.iteration, the same on attention and expert dies,
idle domains included) and applies a row before the agreement of the iteration it names, so all
dies drop a slot at the same boundary."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from mpi4py import MPI

from ranks.core.messages import SHELL
from ranks.core.tags import TAG_MEMORY_FAULT, TAG_PD_DONE
from xds_mpi.eplb.placement import Placement, disable
from xds_mpi.results.failures import FailureRecord


@dataclass(frozen=True, kw_only=True)
class MemoryLoss:
    """Row `row`: die `die` masked blocks first..first+num-1 at its iteration, wall time
    (time.time()) and virtual seconds; the requests it ended."""

    row: int
    die: int
    first_block: int
    num_blocks: int
    iteration: int
    wall: float
    virtual_s: float
    req_ids: tuple[int, ...]

    @property
    def reason(self) -> str:
        last = self.first_block + self.num_blocks - 1
        return f"kv memory fault on die {self.die} blocks {self.first_block}..{last}"


class MemoryCheck:
    """A die's side; `check(die, iteration)` with the busy iterations the die has run, the same
    count on every die (a row's `iteration` is one). site: where the die keeps its slots
    (ranks/recovery/memory.py). Built only where a row applies (`memory_check`)."""

    def __init__(self, ctx, *, site: SlotSite | None = None) -> None:
        self.comm, self.rank = ctx.comm, ctx.comm.rank
        # PD: the decode TE-shell hears the requests a fault ended (0: no decode TE-shell)
        self.decode_shell = ctx.plan.pd.decode_shell if ctx.plan.pd is not None else 0
        self.rows = [
            (i, s)
            for i, s in enumerate(ctx.cfg.faults.events)
            if s.die == self.rank and s.kind == "memory" and s.first_block >= 0
        ]
        self.sends: list[MPI.Request] = []
        # expert slots with a replica elsewhere (ranks/recovery/memory.py)
        self.slots = SlotMask(ctx, site or ColocatedSlots())

    def check(self, die, iteration: int) -> list[int]:
        """Between iterations (`iteration`: the busy iterations the die has run): apply the rows
        now due; the requests they ended."""
        ended = []
        for loss in self.slots.check(die, iteration):
            self.sends.append(self.comm.isend(loss, dest=SHELL, tag=TAG_MEMORY_FAULT))
        for row, spec in [r for r in self.rows if iteration >= r[1].iteration]:
            self.rows.remove((row, spec))
            sched = die.scheduler
            held = sched.table.mask(range(spec.first_block, spec.first_block + spec.num_blocks))
            victims = [r for r in held if r in sched.running]
            _move_receives(die, [r for r in held if r not in sched.running])
            for req_id in victims:
                sched.drop(req_id)
            die.executor.commit(set(victims))  # their MTP state goes too
            ended += victims
            if victims and self.decode_shell:  # PD: its balancer hears them end
                self.sends.append(
                    self.comm.isend(
                        [(r, -1.0) for r in victims], dest=self.decode_shell, tag=TAG_PD_DONE
                    )
                )
            loss = MemoryLoss(
                row=row,
                die=self.rank,
                first_block=spec.first_block,
                num_blocks=spec.num_blocks,
                iteration=iteration,
                wall=time.time(),
                virtual_s=die.pricer.clock.now_ns / 1e9,
                req_ids=tuple(sorted(victims)),
            )
            self.sends.append(self.comm.isend(loss, dest=SHELL, tag=TAG_MEMORY_FAULT))
        self.sends = [r for r in self.sends if not r.Test()]
        return ended


def _move_receives(die, req_ids) -> None:
    """PD: a KV receive in flight lands in its own buffer and reaches the cache only when
    adopted, so its blocks are simply taken again from the healthy ones."""
    for req_id in req_ids:
        incoming, table = die.kv.posted[req_id], die.scheduler.table
        table.free(req_id)
        incoming.slots = tuple(table.allocate(req_id, incoming.task.kv_len))


class MemoryLosses:
    """The TE-shell's side: the dies' losses, kept for the records."""

    def __init__(self, comm, log) -> None:
        self.comm, self.log, self.losses = comm, log, []

    def poll(self) -> list[MemoryLoss | SlotLoss]:
        """The losses that arrived (the frontend ends the requests each names)."""
        taken = []
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_MEMORY_FAULT)) is not None:
            loss: MemoryLoss | SlotLoss = msg.recv()
            if isinstance(loss, SlotLoss):
                self.log.warning("%s: slot masked, replicas %s serve", loss.reason, loss.replicas)
            else:
                self.log.warning("%s: requests %s end", loss.reason, list(loss.req_ids))
            taken.append(loss)
        self.losses += taken
        return taken

    def records(self, requests: dict, roles: dict, started: float, ended: float) -> list:
        """One FailureRecord per loss; requests: the frontend's records (the tokens' times)."""
        times = [t for r in requests.values() for t in r.token_times]
        return [_record(loss, roles, times, started, ended) for loss in self.losses]


def _record(loss, roles, times, started: float, ended: float) -> FailureRecord:
    """Found when injected: the runtime's memory check reports the fault as it happens. A KV
    block fault ends its requests; a slot fault ends none (a replica serves the expert)."""
    at = loss.wall - started

    def rate(a: float, b: float) -> float:
        return sum(1 for t in times if a <= t < b) / (b - a) if b > a else 0.0

    if isinstance(loss, SlotLoss):
        verdict = f"faulty expert slot {loss.slot} (physical slot {loss.phy}, expert {loss.expert})"
        recovery = (
            f"slot masked: expert {loss.expert} served by its replica at physical slot(s) "
            f"{list(loss.replicas)}; no request ended"
        )
        ended_ids = {}
    else:
        verdict = f"faulty KV blocks {loss.first_block}..{loss.first_block + loss.num_blocks - 1}"
        recovery = f"blocks masked; {len(loss.req_ids)} requests ended, the rest continue"
        ended_ids = {"requests_affected": loss.req_ids, "requests_lost": loss.req_ids}
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
        verdict=verdict,
        recovery=recovery,
        tokens_per_s_before=rate(started, loss.wall),
        tokens_per_s_after=rate(loss.wall, ended),
        **ended_ids,
    )


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


def memory_check(ctx, site: SlotSite | None = None) -> MemoryCheck | None:
    """A colocated die's memory check, or None (no call between its iterations) when no row
    applies to it: no KV block row names the die and no slot row is in the run (every die drops
    a faulty slot from its routing)."""
    rank, rows = ctx.comm.rank, [r for r in ctx.cfg.faults.events if r.kind == "memory"]
    if not any(r.slot >= 0 or (r.die == rank and r.first_block >= 0) for r in rows):
        return None
    return MemoryCheck(ctx, site=site)


def afd_memory_check(ctx) -> MemoryCheck | None:
    """An afd die's memory check (`memory_check`), or None."""
    return memory_check(ctx, AfdSlots())


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
