"""Vertical scaling (xDeepServe §6.2 stage 2: "we reduce the number of DP groups and EP ranks,
allowing decode to proceed with fewer NPUs"), both sides, after the TE-shell's detector found
lost dies whose experts all keep a replica (ranks/recovery/detector.py).

The TE-shell (`scale_down`, on its Frontend):
  1. Every surviving die is told which dies are lost (Failover; with EPLB, the TE-shell's EPLB
     agent drops the lost dies first and the message carries its placement without their slots,
     ranks/shell/eplb.py); each rebuilds itself without them and says how many token batches it
     has sent (Ready).
  2. The TE-shell takes every one of those batches, so that what each request emitted is known.
  3. The lost dies' unfinished requests (Frontend.drop_groups) are prefilled again on the other
     DP groups: the prompt and every token already emitted, continued to the same
     max_new_tokens (greedy decoding of the same prefix gives the same next tokens, which
     `--check` verifies against the reference).

A die (`rebuild` on ColocatedDie, ranks/colocated/die.py, and AfdDieBase, ranks/afd/common.py):
  1. The iteration the fence interrupted is undone (Recomputer.restore_interrupted).
  2. The survivors form a communicator of their own (`survivors`: Comm.Create_group, collective
     over the survivors only, never the lost dies), and the die's XCCL buffer rebuilds itself on
     it (EpBuffer.rebuilt / AfdBuffer.rebuilt: a window of its own, the same options); the
     recomputer votes over the survivors from then on (Recomputer.regroup, always with the
     buffers: a vote left on a communicator holding a lost die would never complete). The old
     windows are never used again (nor freed: their frees are collectives the lost dies would
     never join).
  3. The expert placement loses the lost dies' slots (eplb/placement.py remove_die; the
     TE-shell checked that every expert keeps a replica). afd: a lost attention die keeps its
     place in the A2E/E2A layout as rank -1 (its trampoline forwards nothing for it), a lost
     expert die leaves it, and the trampolines are the first G expert dies left (`rerouted`).
  4. The die tells the TE-shell how many token batches it has sent (`send_ready`) and serves on.
     afd: before that the survivors take the highest iteration count among them, as they take
     the highest call count (a die whose part of the fenced iteration was done had counted it;
     AfdDieBase.rebuild).
With no die lost (a stuck die that answered again after the fence), the same steps rebuild the
buffers on every die: the interrupted iteration is recomputed, as after a transient error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mpi4py import MPI

from ranks.core.control import recv_from_each, send_to_each
from ranks.core.tags import TAG_FAILOVER, TAG_FAILOVER_READY
from xds_mpi.eplb.placement import Placement, from_topology, remove_die
from xds_mpi.execution.slots import ExpertSlots
from xds_mpi.plan.failures.checks import release_bound_s
from xds_mpi.plan.failures.loss import FailoverCost


@dataclass(frozen=True, kw_only=True)
class Failover:
    """TE-shell -> every surviving die: lost, the world ranks of the dies to go on without;
    with EPLB, eplb_placement: the placement to install as EPLB version eplb_version."""

    lost: tuple[int, ...]
    eplb_placement: Placement | None = None
    eplb_version: int = 0


@dataclass(frozen=True, kw_only=True)
class Ready:
    """A survivor -> the TE-shell, once rebuilt: num_batches, token batches it sent so far;
    fault_vclock_s, run.clock virtual: its virtual clock where the fault found it, before the
    failover's priced cost moved it on (-1: the wall clock)."""

    die: int
    num_batches: int
    fault_vclock_s: float = -1.0


@dataclass(frozen=True, kw_only=True)
class Routing:
    """An afd attention die's routing after a failover: log2phy, [experts] -> physical slots;
    shared_slots, where its shared column goes (an expert die routes nothing: empty)."""

    log2phy: tuple[tuple[int, ...], ...]
    shared_slots: tuple[int, ...]


# -- the TE-shell's side ----------------------------------------------------------------------
def scale_down(frontend, loss) -> None:
    """Steps 1-3 on the TE-shell's Frontend (ranks/shell/frontend.py) after `loss`
    (detector.Loss); the detector records it."""
    before = len(frontend.groups)
    # With EPLB: its newest placement without the lost dies' slots, as its next version.
    eplb = frontend.eplb.scale_down(loss.lost)
    placement, version = eplb if eplb is not None else (None, 0)
    failover = Failover(lost=loss.lost, eplb_placement=placement, eplb_version=version)
    comm, cfg = frontend.comm, frontend.ctx.cfg
    ready, timeout_s = rebuild(comm, cfg, frontend.detector, loss, failover=failover)  # Step 1
    frontend.take_batches({g: r.num_batches for g, r in ready.items()}, timeout_s)  # Step 2
    priced = _priced(frontend, ready)  # run.clock virtual: (fault, detection, resumption) s
    orphans = frontend.drop_groups(loss.lost)  # Step 3
    frontend.readmit(resumed(frontend.records[r]) for r in sorted(orphans))
    recovery = _recovery(frontend, loss, before, len(orphans), len(ready))
    frontend.log.warning("failover: %s", recovery)
    detected_s = priced[1] if priced else -1.0
    frontend.detector.recovered(loss, recovery, tuple(sorted(orphans)), detected_s)


def _priced(frontend, ready: dict) -> tuple[float, float, float] | None:
    """run.clock virtual: the failover on the virtual clock (docs/virtual_time.md). The fault
    found the survivors at their latest clock (their common start had they gone on); each moved
    its clock past the priced cost (xds_mpi/plan/failures/loss.py FailoverCost), so they resume
    at that start plus the cost, and the TE-shell decides nothing before it: the lost dies'
    requests, readmitted, are decided then (ranks/shell/virtual_time.py failed_over). (fault,
    detection, resumption) virtual seconds; None on the wall clock."""
    if frontend.virtual is None or not ready:
        return None
    cost = FailoverCost.of(frontend.ctx.cfg.health)
    fault_s = max(r.fault_vclock_s for r in ready.values())
    resumed_s = fault_s + cost.total_s
    frontend.virtual.failed_over(resumed_s)
    frontend.log.warning(
        "failover on the virtual clock: fault at %.6f s; detection %g s, release %g s, rebuild "
        "%g s (xds_mpi/plan/failures/loss.py); the survivors resume at %.6f s",
        fault_s,
        cost.detection_s,
        cost.release_s,
        cost.rebuild_s,
        resumed_s,
    )
    return fault_s, fault_s + cost.detection_s, resumed_s


def rebuild(
    comm, cfg, detector, loss, me: str = "TE-shell", failover: Failover | None = None
) -> tuple[dict, float]:
    """Step 1: every surviving watched die (the DP groups, an afd deployment's expert dies)
    rebuilds without `loss.lost`; (die -> its Ready, the timeout the failover's waits use).
    failover: the message (default: the lost dies alone, no EPLB placement)."""
    # The survivors' rebuild is no XCCL wait: a short poll timeout (faults.on_timeout
    # recompute) does not bound it.
    timeout_s = max(cfg.xccl.poll_timeout_s, release_bound_s(cfg.health))
    alive = tuple(g for g in detector.groups if g not in loss.lost)
    opts = {"tag": TAG_FAILOVER, "timeout_s": timeout_s, "me": me, "event": "failover"}
    failover = Failover(lost=loss.lost) if failover is None else failover
    send_to_each(comm, dict.fromkeys(alive, failover), **opts)
    opts = {**opts, "tag": TAG_FAILOVER_READY, "event": "failover ready"}
    return recv_from_each(comm, alive, **opts), timeout_s


def _recovery(frontend, loss, before: int, num_orphans: int, num_left: int) -> str:
    """What the failover did, in words."""
    if not loss.lost:
        return f"buffers rebuilt on all {num_left} dies; the interrupted iteration recomputed"
    experts = frontend.ctx.topo.ranks_with_role("expert")
    if any(d in experts for d in loss.lost):  # afd: the expert dies' slots
        return (
            f"vertical scaling: {len(experts)} -> {len(experts) - len(loss.lost)} expert dies; "
            "their slots removed, every expert kept a replica"
        )
    kind = "attention" if frontend.ctx.cfg.deployment.kind == "afd" else "decode"
    return (
        f"vertical scaling: {before} -> {len(frontend.groups)} {kind} dies; "
        f"{num_orphans} requests re-prefilled on other DP groups"
    )


def resumed(record):
    """A lost request again: its prompt and the tokens it emitted, the rest still to come."""
    req = record.req
    return replace(
        req,
        prompt=tuple(req.prompt) + tuple(record.tokens),
        max_new_tokens=req.max_new_tokens - len(record.tokens),
    )


# -- a die's side -----------------------------------------------------------------------------
def survivors(dies: MPI.Comm, world: MPI.Comm, lost: tuple[int, ...]) -> MPI.Comm:
    """Step 2: the dies of `dies` but the `lost` world ranks, as a communicator of their own
    (collective over the survivors only)."""
    lost_here = MPI.Group.Translate_ranks(world.group, list(lost), dies.group)
    return dies.Create_group(dies.group.Excl(lost_here))


def send_ready(world: MPI.Comm, shell: int, num_batches: int, fault_vclock_s: float = -1.0) -> None:
    """Step 4: the die rebuilt; it has sent `num_batches` token batches (fault_vclock_s: Ready)."""
    ready = Ready(die=world.rank, num_batches=num_batches, fault_vclock_s=fault_vclock_s)
    world.send(ready, dest=shell, tag=TAG_FAILOVER_READY)


def num_routed_dies_left(topo, lost: tuple[int, ...]) -> int:
    """The dies hosting routed slots (make_pricer's count) without the lost ones: the EP size
    the cost model prices dispatch/combine and the experts over after the scaling."""
    return len(ExpertSlots.from_topology(topo).routed_dies - set(lost))


def without_dies(placement: Placement, topo, lost: tuple[int, ...]) -> Placement:
    """Step 3 (colocated): `placement` without the lost dies' slots. A die's expert map numbers
    no dies (without EPLB it never needed them): each slot's die is taken from the topology."""
    placement = replace(placement, slot_die=from_topology(topo, len(placement.phy2log)).slot_die)
    for rank in lost:
        placement = remove_die(placement, topo.ranks[rank].die_idx)
    return placement


def rerouted(die, lost: tuple[int, ...]) -> tuple[Placement, Routing]:
    """Step 3 (afd): the placement without the lost expert dies' slots (remove_die; the
    TE-shell checked a replica is left) and where an attention die sends rows now: every
    expert's slots left, and the shared expert of the die's trampoline (experts[group] of the
    dies left: a lost trampoline's group moves to the expert die after it)."""
    topo, placement = die.topo, die.placement
    for rank in lost:
        if topo.ranks[rank].role == "expert":
            placement = remove_die(placement, topo.ranks[rank].die_idx)
    experts = [r for r in topo.ranks_with_role("expert") if r not in lost]
    shared = ()  # an expert die routes nothing
    if die.afd.role == "attention":
        is_dedicated = die.cfg.deployment.shared_experts == "dedicated"
        trampoline = experts[die.afd.group]
        shared = die.slots.shared_slots_for(trampoline, is_dedicated=is_dedicated)
    return placement, Routing(log2phy=placement.log2phy(0), shared_slots=shared)
