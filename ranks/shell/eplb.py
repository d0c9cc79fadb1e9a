"""The TE-shell's side of expert load balancing (xDeepServe §4.5; the TE-shell triggers it, §4.2).

Step 1: every DP group's count slices arrive (ranks/colocated/eplb.py); a slice that every group
sent is summed into one time slice, and the last `eplb.slices` of them are kept.
Step 2: after every `eplb.slices` new time slices, with no swap in flight, the policy computes a
new placement from the kept slices; the layers where it lowers the predicted max/mean die load
change, and if any does, it goes to every die with the next version number (Step 3 swaps it in).
It also keeps, per slice, what each die measured (routed rows received, MoE virtual time), so the
summary and the run file show the per-layer and per-die load before and after each swap.
Vertical scaling (ranks/recovery/scale_down.py, xDeepServe §6.2 stage 2 "EPLB removes its slots"):
scale_down takes the lost dies out of the groups and the count slices, and makes the newest
placement without their slots the next version, which the survivors install at once
(ranks/colocated/eplb.py take_over); later rebalancing plans over the survivors' slots only.
On the virtual clock (run.clock virtual, docs/virtual_time.md) every completed time slice is
answered to every die with the decision (the new placement, or None for no change): the dies wait
for it before their next iteration (ranks/colocated/eplb.py is_waiting), so the iteration a swap
starts at is decided by the dies' iteration count, not by when the slices reached this rank.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from mpi4py import MPI

from ranks.core.tags import TAG_EPLB_COUNTS, TAG_EPLB_PLACEMENT
from xds_mpi.eplb.placement import Placement, changed_slots, from_topology, remove_die
from xds_mpi.eplb.policy import keep_improvements, predicted_max_over_mean, rebalance
from xds_mpi.eplb.records import PlacementUpdate
from xds_mpi.eplb.report import SCALED_BATCH, EplbReport, Reconfig, SliceTotals
from xds_mpi.eplb.ring import ring_placement
from xds_mpi.plan.eplb import budget
from xds_mpi.projection.moe_time import MoePricing


class EplbShell:
    def __init__(self, ctx, groups: tuple[int, ...], num_moe_layers: int) -> None:
        cfg, topo = ctx.cfg, ctx.topo
        self.cfg, self.comm, self.log, self.groups = cfg.eplb, ctx.comm, ctx.log, groups
        self.all_groups, self.topo = groups, topo  # every DP group the run began with
        self.placement = from_topology(topo, num_moe_layers)
        if cfg.health.replicas == "ring":  # the ring's slots stay put (xds_mpi/eplb/ring.py)
            self.placement = ring_placement(topo, num_moe_layers, fixed=True)
        num_routed_dies = len({d for d, e in zip(self.placement.slot_die, topo.phy2log) if e >= 0})
        self.budget = budget(cfg, num_routed_dies)
        self.pricing = MoePricing.from_config(cfg, num_routed_dies)
        # Mean routed rows a die receives per MoE layer at SCALED_BATCH requests per die.
        self.target_rows = SCALED_BATCH * (1 + cfg.scheduler.mtp_depth) * cfg.model.top_k
        self.dies_per_node = cfg.hardware.dies_per_server
        self.version, self.new_slices, self.is_closing = 0, 0, False
        self.arrived: dict[int, dict] = {}  # slice_idx -> die rank -> CountSlice
        self.window: deque = deque(maxlen=cfg.eplb.slices)  # [num_moe_layers, num_experts] each
        self.slices: list[SliceTotals] = []
        self.reconfigs: list[Reconfig] = []
        self.scalings: list[int] = []  # versions installed by vertical scaling
        self.sends: list[MPI.Request] = []
        self.is_virtual = ctx.plan.clock.is_virtual  # answer every slice (ranks/colocated/eplb.py)

    def poll(self) -> int:
        """Take every count slice that arrived; complete slices, rebalance when due."""
        num = 0
        while (
            message := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_EPLB_COUNTS)
        ) is not None:
            part = message.recv()
            if part.die_rank not in self.groups:  # sent by a die lost since
                continue
            self.arrived.setdefault(part.slice_idx, {})[part.die_rank] = part
            num += 1
        while len(self.arrived.get(len(self.slices), {})) == len(self.groups):
            self._complete(self.arrived.pop(len(self.slices)))
        return num

    def _complete(self, parts: dict) -> None:
        """Step 1: one time slice from every DP group's counts."""
        ordered = [parts.get(rank) for rank in self.all_groups]  # None: a lost die
        totals = SliceTotals.from_parts(ordered)
        self.slices.append(totals)
        self.window.append(totals.counts)
        self.new_slices += 1
        is_idle = totals.version_end == self.version
        update = None
        if self.new_slices >= self.cfg.slices and is_idle and not self.is_closing:
            self.new_slices = 0
            update = self._rebalance()
        if update is not None or (self.is_virtual and not self.is_closing):
            # (at the end the dies' last, partial slices are answered by no one: they left)
            self.sends += [
                self.comm.isend(update, dest=g, tag=TAG_EPLB_PLACEMENT) for g in self.groups
            ]

    def _rebalance(self) -> PlacementUpdate | None:
        """Step 2 on the kept slices; a changed placement, to go to every die (None: none)."""
        counts = np.stack(list(self.window), axis=1)  # [num_moe_layers, num_slices, num_experts]
        proposed = rebalance(
            self.cfg.policy, self.placement, counts, self.budget, dies_per_node=self.dies_per_node
        )
        new = keep_improvements(self.placement, proposed, counts)
        if not changed_slots(self.placement, new):
            return None
        self._next(new, counts)
        return PlacementUpdate(version=self.version, placement=new)

    def scale_down(self, lost: tuple[int, ...]) -> tuple[Placement, int]:
        """Vertical scaling: the DP groups and count slices without the `lost` dies (world
        ranks); the newest placement without their slots (the TE-shell's detector checked that
        every expert keeps a replica) becomes the next version. A placement sent before and not
        yet enabled everywhere is not swapped in phase by phase: the survivors install this one
        at once (ranks/colocated/eplb.py take_over) and drop any older one. Returns (placement,
        version) for the survivors' Failover message."""
        new = self.placement
        for rank in lost:
            new = remove_die(new, self.topo.ranks[rank].die_idx)
        self.groups = tuple(g for g in self.groups if g not in lost)
        for parts in self.arrived.values():
            for rank in lost:
                parts.pop(rank, None)
        self._next(new, np.stack(list(self.window), axis=1) if self.window else None)
        self.scalings.append(self.version)
        self.new_slices = 0  # the next rebalance waits for `slices` slices of the survivors
        self.poll()  # slices the lost dies held back are complete now
        return new, self.version

    def _next(self, new: Placement, counts: np.ndarray | None) -> None:
        """`new` becomes the next version: recorded, logged, and the TE-shell's placement.
        counts: the kept slices [num_moe_layers, num_slices, num_experts] (None: none yet)."""
        predicted = ((float("nan"),) * len(new.phy2log),) * 2
        if counts is not None:
            predicted = tuple(predicted_max_over_mean(p, counts) for p in (self.placement, new))
        self.version += 1
        reconfig = Reconfig(
            version=self.version,
            after_slice=len(self.slices) - 1,
            num_changed_slots=len(changed_slots(self.placement, new)),
            predicted_before=tuple(predicted[0]),
            predicted_after=tuple(predicted[1]),
            phy2log=new.phy2log,
        )
        self.reconfigs.append(reconfig)
        self.placement = new
        self.log.info(
            "EPLB v%d after slice %d: %d redundant slots change; predicted max/mean per MoE "
            "layer %s -> %s",
            reconfig.version,
            reconfig.after_slice,
            reconfig.num_changed_slots,
            _ratios(reconfig.predicted_before),
            _ratios(reconfig.predicted_after),
        )

    def finish(self) -> None:
        """After the dies' reports: the last slices (no more rebalancing)."""
        self.is_closing = True
        self.poll()
        self.sends = [r for r in self.sends if not r.Test()]

    def report(self) -> EplbReport:
        return EplbReport.from_slices(
            self.slices, self.reconfigs, self.pricing, self.target_rows, tuple(self.scalings)
        )


def _ratios(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


class NoEplbShell:
    """EPLB disabled: nothing to collect."""

    def poll(self) -> int:
        return 0

    def finish(self) -> None:
        pass

    def scale_down(self, lost: tuple[int, ...]) -> None:
        return None

    @property
    def placement(self) -> None:
        """No placement of EPLB's: the expert placement is the static one."""
        return None


def make_eplb_shell(ctx, groups: tuple[int, ...]) -> EplbShell | NoEplbShell:
    if not ctx.cfg.eplb.enabled:
        return NoEplbShell()
    model = ctx.cfg.model
    num_moe_layers = model.num_layers - model.num_dense_layers + ctx.cfg.scheduler.mtp_depth
    return EplbShell(ctx, groups, num_moe_layers)
