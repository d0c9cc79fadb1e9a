"""Fault injection (xDeepServe §6): the emulator's stand-ins for the failures a pod has, each
installed on a die only when a configured row can fire there, chosen once when the die is built,
so that a die with no such row runs nothing of it. Detection and recovery (ranks/recovery/) never
import this package: they see a fault only the way the pod would (a silent die, a wait that does
not end, an XCCL error).

  - `dead.py` `DeadDie` (a `dead` row): after the die's iteration `iteration` it answers nothing
    and runs no iteration (ranks/core/decode_die.py DieWatch.fall_silent); built by a watched
    colocated or afd die that the row names, checked by the die after each of its iterations.
  - `stuck.py` `Stall` (a `stuck` row): the fault hook of the die's XCCL buffers that blocks
    inside its first dispatch / A2E of iteration `iteration`; given to the die's recomputer only
    on the die the row names (ranks/recovery/recompute.py `stall`).
  - `kv_transfer.py` `KvFaults` (`p2p_send` / `p2p_recv` rows of faults.table, or the random mode
    over them): the fault hook of a PD die's P2P, installed through its `set_recovery`.

Where transient XCCL errors strike (faults.table / faults.rate) is xds_mpi/execution/faults.py
`FaultPlan`, whose check the recomputer installs only where a row or the random mode can hit the
die; memory rows are reported by the die's runtime stand-in in ranks/recovery/memory.py, built
only where a row applies; PD's link and saturated faults and a lost prefill die are emulated on
their dies in ranks/pd/ (`channel.py`, `prefill_loss.py`).
"""
