"""An afd die's side of vertical scaling (xDeepServe §6.2 stage 2) after the TE-shell's fence
released it (ranks/detector.py): the attention and expert dies left go on without the lost ones.

  1. The iteration the fence interrupted is undone (ranks/recompute.py restore_interrupted).
  2. The survivors form a communicator of their own (Comm.Create_group over the survivors only),
     a window on it and a fresh A2E/E2A buffer; the old ones are never used again (nor freed:
     their frees are collectives the lost dies would never join). Every survivor numbers the
     next calls alike (the highest call count among them).
  3. A lost attention die keeps its place in the layout, as rank -1: its trampoline forwards no
     rows for it and returns it none (xccl/afd_expert.py), so every expert die still hears from
     every trampoline and stops expecting the lost die's tokens. Its DP domain goes on with the
     dies it has left; with none left the domain is never busy again.
  4. The die tells the TE-shell how many token batches it has sent (attention dies: so that the
     TE-shell has every token before it re-prefills the lost die's requests elsewhere).
A lost expert die stops the run before this (its experts have no replica on the expert dies:
ranks/detector.py); with no die lost (a stuck die that answered again) the same steps rebuild
the buffer on every die and the interrupted iteration is recomputed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from mpi4py import MPI

from ranks.die_failover import Failover, Ready
from xccl.afd import AfdBuffer
from xccl.faults import RecoveryHooks
from xccl.gmem import DieMemory
from xds_mpi.tags import TAG_FAILOVER_READY

SHELL = 0


def scale_down(die, failover: Failover) -> None:
    """Steps 1-4 on afd die `die` (ranks/afd_common.py AfdDieBase)."""
    world = die.ctx.comm
    die.recompute.restore_interrupted()  # Step 1
    lost_here = MPI.Group.Translate_ranks(world.group, list(failover.lost), die.dies.group)
    survivors = die.dies.Create_group(die.dies.group.Excl(lost_here))  # Step 2
    afd = rebuilt_buffer(die.afd, survivors)  # Step 3: the lost dies as -1
    die.install(afd)
    die.afd, die.recompute.buffers = afd, [afd]
    die.dies = die.recompute.comm = survivors
    die.plan.num_calls = survivors.allreduce(die.plan.num_calls, op=MPI.MAX)
    die.is_scaled = True
    outbox = getattr(die, "outbox", None)  # Step 4
    ready = Ready(die=world.rank, num_batches=outbox.num_batches if outbox else 0)
    world.send(ready, dest=SHELL, tag=TAG_FAILOVER_READY)


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
        experts=tuple(to_new[r] for r in layout.experts),  # every expert die is left
        base=(0,) * comm.size,
    )
    nbytes = -(-layout.area_bytes(old.role) // 8) * 8
    afd = AfdBuffer(
        DieMemory(comm, nbytes),
        layout,
        np.array([to_new[int(r)] for r in old.slot_owner], np.int64),
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
