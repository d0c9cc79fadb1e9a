"""A colocated die's side of vertical scaling (xDeepServe §6.2 stage 2): after the TE-shell's fence
released it (ranks/recovery/detector.py), the die learns which dies are lost and goes on without
them.

  1. The iteration the fence interrupted is undone (ranks/recovery/recompute.py
  restore_interrupted): the
     scheduler, KV lengths, MTP drafts and virtual clock as they were where it started.
  2. The survivors form a communicator of their own (Comm.Create_group: collective over the
     survivors only, never the lost dies), a window on it and fresh XCCL buffers; the old ones
     are never used again (nor freed: their frees are collectives the lost dies would never join).
  3. The expert placement loses the lost dies' slots (eplb/placement.py remove_die; the TE-shell
     checked that every expert keeps a replica); the routing now avoids them. With EPLB the
     TE-shell sends that placement (its newest, without the lost slots) as EPLB's next version,
     which the die installs at once (ranks/colocated/eplb.py take_over).
  4. The die tells the TE-shell how many token batches it has sent, so that the TE-shell has
     every token before it re-prefills the lost dies' requests elsewhere, and serves on.
With no die lost (a stuck die that answered again after the fence), the same steps rebuild the
buffers on every die: the interrupted iteration is recomputed, as after a transient error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mpi4py import MPI

from xccl.ep.buffer import EpBuffer
from xccl.gmem import DieMemory
from xccl.recovery.faults import RecoveryHooks
from xds_mpi.engine.slots import ExpertSlots
from xds_mpi.eplb.placement import Placement, from_topology, remove_die
from xds_mpi.tags import TAG_FAILOVER, TAG_FAILOVER_READY

SHELL = 0


@dataclass(frozen=True, kw_only=True)
class Failover:
    """TE-shell -> every surviving die: lost, the world ranks of the dies to go on without;
    with EPLB, eplb_placement: the placement to install as EPLB version eplb_version."""

    lost: tuple[int, ...]
    eplb_placement: Placement | None = None
    eplb_version: int = 0


@dataclass(frozen=True, kw_only=True)
class Ready:
    """A survivor -> the TE-shell, once rebuilt: num_batches, token batches it sent so far."""

    die: int
    num_batches: int


def take_failover(comm: MPI.Comm, shell: int = SHELL) -> Failover | None:
    """shell: the watcher's rank (PD: the decode TE-shell, ranks/recovery/die_health.py watcher)."""
    message = comm.improbe(source=shell, tag=TAG_FAILOVER)
    return None if message is None else message.recv()


def scale_down(die, failover: Failover) -> None:
    """Steps 1-4 on colocated die `die` (ranks/colocated/die.py ColocatedDie)."""
    world = die.outbox.comm
    die.recompute.restore_interrupted()  # Step 1
    lost_here = MPI.Group.Translate_ranks(world.group, list(failover.lost), die.dies.group)
    survivors = die.dies.Create_group(die.dies.group.Excl(lost_here))  # Step 2
    die.retired.append((die.dies, die.executor.ep.mem))
    ep = _new_buffer(die.executor.ep, survivors, world)
    die.executor.ep, die.recompute.buffers = ep, [ep]
    die.dies = survivors
    die.recompute.regroup(survivors)  # its votes too (faults.on_timeout recompute)
    die.is_scaled = True
    die.pricer.rescale(num_routed_dies_left(die.topo, failover.lost))
    if failover.eplb_placement is not None:  # Step 3
        die.eplb.take_over(failover.eplb_placement, failover.eplb_version)
    else:
        expert_map = die.executor.expert_map
        placement = with_dies(expert_map.placement, die.topo)
        for rank in failover.lost:
            placement = remove_die(placement, die.topo.ranks[rank].die_idx)
        expert_map.install(placement)
    ready = Ready(die=world.rank, num_batches=die.outbox.num_batches)  # Step 4
    world.send(ready, dest=die.health.shell, tag=TAG_FAILOVER_READY)


def num_routed_dies_left(topo, lost: tuple[int, ...]) -> int:
    """The dies hosting routed slots (make_pricer's count) without the lost ones: the EP size
    the cost model prices dispatch/combine and the experts over after the scaling."""
    return len(ExpertSlots.from_topology(topo).routed_dies - set(lost))


def with_dies(placement: Placement, topo) -> Placement:
    """The placement with each slot's die as the topology has it (a die's expert map numbers
    no dies: without EPLB it never needed them)."""
    dies = from_topology(topo, len(placement.phy2log)).slot_die
    return replace(placement, slot_die=dies)


def _new_buffer(old: EpBuffer, comm: MPI.Comm, world: MPI.Comm) -> EpBuffer:
    """Dispatch/combine over `comm`, the survivors, on a window of its own; slots of the lost
    dies owned by nobody (-1: the routing never picks them)."""
    layout = replace(old.layout, members=tuple(range(comm.size)), base=(0,) * comm.size)
    nbytes = -(-layout.offset(comm.rank, "end") // 8) * 8
    mem = DieMemory(comm, nbytes)
    in_world = MPI.Group.Translate_ranks(comm.group, list(range(comm.size)), world.group)
    to_new = {w: n for n, w in enumerate(in_world)}
    ep = EpBuffer(
        mem,
        layout,
        [to_new.get(int(owner), -1) for owner in old.slot_owner],
        dtype=old.dtype,
        clock=old.clock,
        link=old.link,
        num_cores=old.num_cores,
        timeout_s=old.timeout_s,
        wait_span=old.wait_span,
    )
    ep.set_recovery(RecoveryHooks(interrupt=old.interrupt, fault_hook=old.fault_hook))
    return ep
