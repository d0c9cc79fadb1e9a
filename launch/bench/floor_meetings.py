"""The meeting floor of `xds-mpi bench ep`: what two all-to-all meetings cost on this machine,
with no rows, no records and no bookkeeping, written as plainly as numpy allows.

A dispatch and a combine are each a meeting of every die: each rings a doorbell in every die's
window and waits until every die rang in its own. Here a meeting is only that: one 8-byte store
into each peer's window, a memory barrier, then a poll of its own words (one numpy compare,
`sched_yield` between tries) until all of them hold the round's number. It is the part of a
dispatch + combine round that no protocol whose dies all meet can avoid on these cores: with more
ranks than cores, every rank must be scheduled once after the last one rang. xccl / floor is the
price of everything else (rows, records, checks, the virtual clock); on the load/store path only
(a peer on another node: nan).
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from xccl.gmem import DieMemory


class Meetings:
    """Every rank's word in every rank's window; `round` is two meetings (dispatch, combine)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.mem = DieMemory(comm, 8 * comm.size, memory_path="auto")
        self.mem.words[:] = 0
        me = comm.rank
        views = self.mem.views
        # Our word in each peer's window, or None when a peer is reached only by RMA.
        self.bells = None
        if all(v is not None for v in views):
            self.bells = [v.view(np.uint64)[me : me + 1] for v in views]
        self.number = 0
        comm.Barrier()  # every window zeroed before anyone rings

    @property
    def available(self) -> bool:
        return self.bells is not None

    def round(self) -> None:
        self._meet()
        self._meet()

    def _meet(self) -> None:
        self.number += 1
        number, words, win = np.uint64(self.number), self.mem.words, self.mem.win
        for bell in self.bells:
            bell[0] = number
        win.Sync()
        deadline = time.monotonic() + 60
        while True:
            win.Sync()
            # A peer already in the next meeting rang a larger number: it counts as here.
            if not np.count_nonzero(words < number):
                return
            if time.monotonic() > deadline:
                late = np.flatnonzero(words < number).tolist()
                raise TimeoutError(f"rank {self.mem.rank}: meeting {self.number}: ranks {late}")
            os.sched_yield()

    def free(self) -> None:
        self.mem.free()
