"""An afd die's side of vertical scaling (xDeepServe §6.2 stage 2) after the TE-shell's fence
released it (ranks/recovery/detector.py): the attention and expert dies left go on without the lost
ones.

  1. The iteration the fence interrupted is undone (ranks/recovery/recompute.py
  restore_interrupted).
  2. The survivors form a communicator of their own (Comm.Create_group over the survivors only),
     a window on it and a fresh A2E/E2A buffer; the old ones are never used again (nor freed:
     their frees are collectives the lost dies would never join). Every survivor numbers the
     next calls alike (the highest call count among them).
  3. A lost attention die keeps its place in the layout, as rank -1: its trampoline forwards no
     rows for it and returns it none (xccl/afd/expert.py), so every expert die still hears from
     every trampoline and stops expecting the lost die's tokens. Its DP domain goes on with the
     die it has left. A lost expert die leaves the layout; the placement loses its slots
     (remove_die: with health.replicas "ring" every expert keeps a replica, else the TE-shell
     stopped the run), and the trampolines are the first G expert dies left.
  4. The die tells the TE-shell how many token batches it has sent (attention dies: so that the
     TE-shell has every token before it re-prefills the lost die's requests elsewhere).
With no die lost (a stuck die that answered again) the same steps rebuild
the buffer on every die and the interrupted iteration is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from mpi4py import MPI

from ranks.recovery.die_failover import Failover, Ready
from xccl.afd.buffer import AfdBuffer
from xccl.gmem import DieMemory
from xccl.recovery.faults import RecoveryHooks
from xds_mpi.eplb.placement import remove_die
from xds_mpi.tags import TAG_FAILOVER_READY

SHELL = 0


@dataclass(frozen=True, kw_only=True)
class Routing:
    """An attention die's routing after a failover: log2phy, [experts] -> physical slots;
    shared_slots, where its shared column goes."""

    log2phy: tuple[tuple[int, ...], ...]
    shared_slots: tuple[int, ...]


def scale_down(die, failover: Failover) -> None:
    """Steps 1-4 on afd die `die` (ranks/afd/common.py AfdDieBase)."""
    world = die.ctx.comm
    die.recompute.restore_interrupted()  # Step 1
    lost_here = MPI.Group.Translate_ranks(world.group, list(failover.lost), die.dies.group)
    survivors = die.dies.Create_group(die.dies.group.Excl(lost_here))  # Step 2
    afd = rebuilt_buffer(die.afd, survivors)  # Step 3: the lost dies as -1
    die.afd, die.recompute.buffers = afd, [afd]
    die.install(afd, rerouted(die, failover.lost))
    die.dies = survivors
    die.recompute.regroup(survivors)  # its votes too (faults.on_timeout recompute)
    die.plan.num_calls = survivors.allreduce(die.plan.num_calls, op=MPI.MAX)
    die.is_scaled = True
    outbox = getattr(die, "outbox", None)  # Step 4
    ready = Ready(die=world.rank, num_batches=outbox.num_batches if outbox else 0)
    world.send(ready, dest=SHELL, tag=TAG_FAILOVER_READY)


def rerouted(die, lost: tuple[int, ...]) -> Routing:
    """Where the attention dies send rows now: every expert's slots without the lost expert
    dies' (eplb/placement.py remove_die; the TE-shell checked a replica is left), and the
    shared expert of the die's trampoline (experts[group] of the dies left: a lost trampoline's
    group moves to the expert die after it)."""
    topo, placement = die.topo, die.placement
    for rank in lost:
        if topo.ranks[rank].role == "expert":
            placement = remove_die(placement, topo.ranks[rank].die_idx)
    die.placement = placement
    experts = [r for r in topo.ranks_with_role("expert") if r not in lost]
    shared = ()  # an expert die routes nothing
    if die.afd.role == "attention":
        is_dedicated = die.cfg.deployment.shared_experts == "dedicated"
        trampoline = experts[die.afd.group]
        shared = die.slots.shared_slots_for(trampoline, is_dedicated=is_dedicated)
    return Routing(log2phy=placement.log2phy(0), shared_slots=shared)


def rebuilt_buffer(old: AfdBuffer, comm: MPI.Comm) -> AfdBuffer:
    """A2E/E2A over `comm`, the survivors, on a window of its own: the layout's ranks are the
    survivors' ranks in `comm` (-1: a lost attention die), each area at the window's start."""
    before = old.mem.comm  # the communicator the old layout numbers ranks in
    in_before = MPI.Group.Translate_ranks(comm.group, list(range(comm.size)), before.group)
    to_new = {w: n for n, w in enumerate(in_before)}
    layout = old.layout
    layout = replace(
        layout,
        attention=tuple(to_new.get(r, -1) for r in layout.attention),
        experts=tuple(to_new[r] for r in layout.experts if r in to_new),
        base=(0,) * comm.size,
    )
    nbytes = -(-layout.area_bytes(old.role) // 8) * 8
    afd = AfdBuffer(
        DieMemory(comm, nbytes),
        layout,
        np.array([to_new.get(int(r), -1) for r in old.slot_owner], np.int64),  # -1: lost
        num_routed_slots=old.num_routed_slots,
        use_trampolines=old.use_trampolines,
        dtype=old.dtype,
        clock=old.clock,
        link=old.link,
        num_cores=old.num_cores,
        timeout_s=old.timeout_s,
        wait_span=old.wait_span,
    )
    afd.set_recovery(RecoveryHooks(interrupt=old.interrupt, fault_hook=old.fault_hook))
    return afd
