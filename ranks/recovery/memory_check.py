"""On-chip memory faults in a die's KV cache (xDeepServe §6.2 stage 3), both ends.

The die (`MemoryCheck`, called between iterations; a colocated die, or an afd attention die:
ranks/recovery/afd_memory.py): when it reaches a `memory` row's iteration, its runtime reports KV
blocks [first_block, first_block + num_blocks) faulty (the emulator's stand-in for the CANN
runtime's memory check: reported at once). The die masks them (never
handed out again, the pool shrinks) and ends every request whose KV had a block there: its KV
is gone, so it leaves the batch with a reason and its other blocks go back. The rest continue
untouched. The die tells the TE-shell (MemoryLoss).

The TE-shell (`MemoryLosses`, polled from its loop): each named request ends with its reason
(recorded in the run file, skipped by name by `--check` and counted apart), and one
FailureRecord per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

from ranks.core.messages import SHELL
from ranks.recovery.slot_mask import ColocatedSlots, SlotLoss, SlotMask, SlotSite, slot_record
from xds_mpi.failures import FailureRecord
from xds_mpi.tags import TAG_MEMORY_FAULT, TAG_PD_DONE


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
    """A die's side; `check(die)` reads die.busy_iterations, the iterations the die has run,
    the same count on every die (a row's `iteration` is one). site: where the die keeps its
    slots (ranks/recovery/slot_mask.py)."""

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
        # expert slots with a replica elsewhere (ranks/recovery/slot_mask.py)
        self.slots = SlotMask(ctx, site or ColocatedSlots())

    def check(self, die) -> list[int]:
        """Between iterations: apply the rows now due; the requests they ended."""
        iteration, ended = die.busy_iterations, []
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
                    self.comm.isend(list(victims), dest=self.decode_shell, tag=TAG_PD_DONE)
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
    """Found when injected: the runtime's memory check reports the fault as it happens."""
    at = loss.wall - started

    def rate(a: float, b: float) -> float:
        return sum(1 for t in times if a <= t < b) / (b - a) if b > a else 0.0

    if isinstance(loss, SlotLoss):
        return slot_record(loss, roles, rate, started, ended)
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
        verdict=f"faulty KV blocks {loss.first_block}..{loss.first_block + loss.num_blocks - 1}",
        recovery=f"blocks masked; {len(loss.req_ids)} requests ended, the rest continue",
        requests_affected=loss.req_ids,
        requests_lost=loss.req_ids,
        tokens_per_s_before=rate(started, loss.wall),
        tokens_per_s_after=rate(loss.wall, ended),
    )
