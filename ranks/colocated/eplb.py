"""A colocated die's side of expert load balancing (xDeepServe §4.5, Figure 12).

Step 1: after each iteration the die adds its gate's counts (the executor's ExpertMap) to the
current time slice; every `eplb.interval` iterations it sends the slice to the TE-shell. In TP=1
a DP group is one die, so the group's aggregate is the die's own count.
Step 3: a placement the TE-shell computed (Step 2) is swapped in over several iterations while
decoding goes on, each phase starting at an iteration boundary that every die agrees on through
the one-sided agreement of the dies (xccl/agreement.py):
  phase 1 prefetch: copy the new replicas' weights from the checkpoint the die holds in host
          memory (priced as a pull over the UB from a die hosting the expert);
  phase 2 disable: the redundant slots that change are emptied in log2phy (tokens go to the
          remaining replicas, always at least the routed slot);
  phase 3 load: `eplb.load_slots_per_iteration` slots per iteration get their weights, while the
          iterations keep decoding;
  phase 4 enable: once every die has loaded, the new placement is installed at the next boundary.
Step 4 (rotation over replicas) happens inside dispatch (xccl/routing.py).
On the virtual clock (run.clock virtual, docs/virtual_time.md) the TE-shell answers every count
slice with its decision (a placement, or None: no change), and a die runs no iteration after
sending a slice before it holds the decision for it (`is_waiting`): every die then takes a new
placement into the agreement at the same iteration, the first after the slice that triggered it,
whatever the wall time the TE-shell took, so the swap's iterations are the same in every run.
Vertical scaling (ranks/recovery/scale_down.py): a survivor installs at once the placement the
TE-shell
made without the lost dies' slots (take_over), loading the weights its slots lack; a swap in
progress and any older placement still on its way are dropped.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ranks.core.control import WaitTimeout
from ranks.core.messages import SHELL
from ranks.core.tags import TAG_EPLB_COUNTS, TAG_EPLB_PLACEMENT
from xds_mpi.eplb.placement import changed_slots, disable
from xds_mpi.eplb.records import CountSlice, PlacementUpdate
from xds_mpi.plan.failures.loss import release_bound_s
from xds_mpi.report import trace

MOE_OPS = ("gate", "dispatch", "experts", "combine")


@dataclass
class SliceBook:
    """The time slice being collected (mutable: one per die, reset when sent)."""

    counts: np.ndarray  # [num_moe_layers, num_experts]
    rows_in: np.ndarray  # [num_moe_layers]
    moe_vtime_s: float = 0.0
    num_iterations: int = 0
    num_loading: int = 0
    num_prefill: int = 0
    version_start: int = 0


@dataclass(frozen=True, kw_only=True)
class StagedLoad:
    """A replica's weights staged by phase 1, to load into redundant slot `slot` of placement
    row `row` in phase 3."""

    row: int
    slot: int
    expert_idx: int
    weights: object  # the expert's module, copied from the checkpoint in host memory


@dataclass
class Swap:
    """A reconfiguration in progress: the target placement and the slots still to load."""

    update: PlacementUpdate
    to_load: list = field(default_factory=list)  # [StagedLoad]


class EplbDie:
    def __init__(self, cfg, comm: MPI.Comm, executor, pricer, *, is_virtual: bool = False) -> None:
        self.cfg, self.comm = cfg.eplb, comm
        self.me, self.timeout_s = comm.rank, cfg.xccl.poll_timeout_s
        # Virtual clock: the TE-shell's decisions taken (one per count slice, in order), and how
        # long a die waits for one: the TE-shell may be in a failover meanwhile.
        self.is_virtual, self.num_decisions = is_virtual, 0
        self.decision_timeout_s = self.timeout_s + release_bound_s(cfg.health)
        self.waiting_since: float | None = None  # time.monotonic() while waiting for a decision
        self.executor, self.pricer = executor, pricer
        self.expert_map = executor.expert_map
        self.version, self.received = 0, None  # placement in use; newest PlacementUpdate
        self.stale_upto = 0  # placements up to this version were dropped by a take_over
        self.swap: Swap | None = None
        self.num_slices, self.pending = 0, []
        self.book = self._new_book()
        self.load_s = 0.0  # virtual seconds of weight loads (off the critical path)
        self.moe_vtime_before_s = 0.0
        self.num_loading_iterations = 0

    def _new_book(self) -> SliceBook:
        shape = self.expert_map.counts.shape
        return SliceBook(
            counts=np.zeros(shape, np.int64),
            rows_in=np.zeros(shape[0], np.int64),
            version_start=self.version,
        )

    # -- Step 3: at each iteration boundary (agreed over the dies' windows) ---------------------
    def boundary_values(self) -> tuple[int, int]:
        """This die's part of the boundary agreement (ranks/colocated/die.py agree): the newest
        placement it has, and 1 once it has nothing left to load."""
        self._take_placements()
        return (
            self.received.version if self.received else 0,
            0 if self.swap and self.swap.to_load else 1,
        )

    def _take_placements(self) -> None:
        """The TE-shell's placements that arrived (virtual clock: its decisions, None for no
        change)."""
        while (message := self.comm.improbe(source=SHELL, tag=TAG_EPLB_PLACEMENT)) is not None:
            update = message.recv()
            self.num_decisions += 1
            if update is not None and update.version > self.stale_upto:
                self.received = update

    def is_waiting(self, is_stopped: bool) -> bool:
        """Virtual clock: has this die sent a count slice whose decision it does not hold yet?
        It then runs no iteration (nor the agreement) until the decision comes, so that every die
        agrees on it at the same iteration. Bounded; a stop ends the wait (no iteration follows)."""
        if not self.is_virtual or is_stopped:
            return False
        self._take_placements()
        if self.num_decisions >= self.num_slices:
            self.waiting_since = None
            return False
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        elif now - self.waiting_since > self.decision_timeout_s:
            raise WaitTimeout(
                f"die rank {self.me}: no EPLB decision from the TE-shell (rank {SHELL}) for count "
                f"slice {self.num_decisions} after {self.decision_timeout_s:g} s"
            )
        time.sleep(0.0005)
        return True

    def at_boundary(self, agreed: tuple[int, int]) -> None:
        """With `agreed` the minimum of every die's boundary_values: the newest placement all
        have and whether all loads are done, move the swap on by one phase; then load this
        iteration's share."""
        if self.swap and agreed[1]:
            trace.instant("eplb", phase="enable", version=self.swap.update.version)
            self._enable()
        elif not self.swap and agreed[0] > self.version:
            # The TE-shell sends a placement only once the previous one is in use everywhere.
            assert self.received.version == agreed[0], (self.received.version, agreed[0])
            with trace.span("eplb", phase="prefetch + disable", version=self.received.version):
                self._prefetch_and_disable(self.received)
        if self.swap:
            with trace.span("eplb", phase="load", version=self.swap.update.version):
                self._load()
            self.book.num_loading += 1
            self.num_loading_iterations += 1
        self.moe_vtime_before_s = self.moe_vtime_s()

    def _prefetch_and_disable(self, update: PlacementUpdate) -> None:
        """Phases 1 and 2: stage this die's new replicas' weights; empty every changed
        redundant slot (all dies, the same ones) in log2phy."""
        old, new = self.expert_map.placement, update.placement
        changed = changed_slots(old, new)
        owner = self.executor.slots.slot_owner
        mine = [(row, slot) for row, slot in changed if owner[slot] == self.me]
        staged = [
            StagedLoad(row=row, slot=slot, expert_idx=expert, weights=self._weights(row, expert))
            for row, slot in mine
            if (expert := new.phy2log[row][slot]) >= 0
        ]
        self.expert_map.install(disable(old, changed))
        self.swap = Swap(update=update, to_load=staged)

    def _weights(self, row: int, expert: int):
        """Phase 1's copy of expert `expert` of placement row `row`, from the checkpoint the die
        holds in host memory."""
        moe = self.executor.model.moe_of(self.expert_map.moe_layers[row])
        return copy.deepcopy(moe.experts[expert])

    def take_over(self, placement, version: int) -> None:
        """Vertical scaling: `placement` (the TE-shell's newest, without the lost dies' slots)
        is version `version`, in use from the next iteration; this die's redundant slots that
        do not hold their expert's weights yet load them now (priced as pulls, like phase 3).
        A swap in progress, and any placement up to `version` still on its way, are dropped."""
        owner, held = self.executor.slots.slot_owner, self.expert_map.weights
        for row, experts in enumerate(placement.phy2log):
            for slot, expert in enumerate(experts):
                mine = placement.is_redundant[slot] and owner[slot] == self.me and expert >= 0
                if mine and held.get((row, slot), (-1, None))[0] != expert:
                    self.expert_map.load(row, slot, expert, self._weights(row, expert))
                    self.load_s += self.pricer.cost.expert_pull()
        self.expert_map.install(placement)
        self.version = self.stale_upto = version
        self.swap = self.received = None

    def _load(self) -> None:
        """Phase 3: up to load_slots_per_iteration slots get their weights this iteration."""
        for _ in range(min(self.cfg.load_slots_per_iteration, len(self.swap.to_load))):
            staged = self.swap.to_load.pop(0)
            self.expert_map.load(staged.row, staged.slot, staged.expert_idx, staged.weights)
            self.load_s += self.pricer.cost.expert_pull()

    def _enable(self) -> None:
        """Phase 4: every die has loaded; the new placement serves from this iteration on."""
        self.expert_map.install(self.swap.update.placement)
        self.version = self.swap.update.version
        self.swap = None

    # -- Step 1: after each committed iteration --------------------------------------------------
    def after_iteration(self) -> None:
        """Add the iteration's counts to the slice; send the slice every `interval` iterations."""
        book = self.book
        book.counts += self.expert_map.counts
        book.rows_in += self.expert_map.rows_in
        book.moe_vtime_s += self.moe_vtime_s() - self.moe_vtime_before_s
        book.num_iterations += 1
        book.num_prefill += int(self.expert_map.has_prefill)
        if book.num_iterations == self.cfg.interval:
            self._send_slice()

    def moe_vtime_s(self) -> float:
        """Virtual seconds the die spent in MoE operations so far (main and MTP layers)."""
        spent = self.pricer.snapshot()
        return sum(spent.get(p + op, 0.0) for op in MOE_OPS for p in ("", "MTP "))

    def _send_slice(self) -> None:
        book = self.book
        record = CountSlice(
            die_rank=self.me,
            slice_idx=self.num_slices,
            counts=book.counts,
            rows_in=book.rows_in,
            moe_vtime_s=book.moe_vtime_s,
            num_iterations=book.num_iterations,
            version_start=book.version_start,
            version_end=self.version,
            num_loading=book.num_loading,
            num_prefill=book.num_prefill,
            load_s=self.load_s,
        )
        self.pending.append(self.comm.isend(record, dest=SHELL, tag=TAG_EPLB_COUNTS))
        self.pending = [r for r in self.pending if not r.Test()]
        self.num_slices += 1
        self.book = self._new_book()

    def flush(self) -> None:
        """Send the last, partial slice (before the die's report, so the TE-shell has it)."""
        if self.book.num_iterations:
            self._send_slice()

    def close(self) -> None:
        """Wait for the slices sent; take any placement the TE-shell sent too late to use."""
        deadline = time.monotonic() + self.timeout_s
        while self.pending:
            self.pending = [r for r in self.pending if not r.Test()]
            if self.pending and time.monotonic() > deadline:
                raise WaitTimeout(
                    f"die rank {self.me}: {len(self.pending)} EPLB count slices not taken by "
                    f"the TE-shell after {self.timeout_s:g} s"
                )
            time.sleep(0.0005)
        while (message := self.comm.improbe(source=SHELL, tag=TAG_EPLB_PLACEMENT)) is not None:
            message.recv()
