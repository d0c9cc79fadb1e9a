"""The protocol floor of `xds-mpi bench p2p`: what any ring protocol with a record and an ack
costs in Python on this machine, written as plainly as numpy allows.

One message: the sender stores the bytes into its ring in the receiver's window, an 8-word
record, a memory barrier, the doorbell; the receiver polls the doorbell, reads and checks the
record, copies the bytes out, stores the ack; the sender's send ends when it sees the ack. This is
xccl/p2p/channel.py's Figure 4 sequence without its generality (queues, async handles, several
publications per message, fault hooks, the virtual clock, bounds checks), on the load/store path
only (no floor where the peer is reached by RMA: nan). The ratio
xccl / floor is the price of that generality; floor / raw ls is what no Python ring protocol can
avoid.
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from xccl.gmem import DieMemory

RECORD_WORDS = 8


class FloorPair:
    """One pair's floor round trip (each rank of the pair holds one)."""

    def __init__(self, comm: MPI.Comm, peer: int, max_bytes: int) -> None:
        self.ring = (max_bytes + 7) // 8 * 8
        self.record, self.bell, self.ack = self.ring, self.ring + 64, self.ring + 72
        self.mem = DieMemory(comm, self.ring + 80, memory_path="auto")
        self.peer, self.is_a = peer, comm.rank % 2 == 0
        self.theirs, self.mine = self.mem.views[peer], self.mem.local
        self._record = np.zeros(RECORD_WORDS, np.uint64)

    def rtt(self, buf: np.ndarray, out: np.ndarray, i: int) -> None:
        seq = i % (1 << 40) + 1
        if self.is_a:
            self._send(buf, seq)
            self._recv(out, seq)
        else:
            self._recv(out, seq)
            self._send(buf, seq)

    def _send(self, buf: np.ndarray, seq: int) -> None:
        theirs, win = self.theirs.view(np.uint64), self.mem.win
        self.theirs[: buf.nbytes] = buf
        self._record[:] = (seq, 0, buf.nbytes, buf.nbytes, seq, 0, 2, 0)
        theirs[self.record // 8 : self.record // 8 + RECORD_WORDS] = self._record
        win.Sync()
        theirs[self.bell // 8] = seq
        win.Sync()
        self._wait(self.ack // 8, seq)

    def _recv(self, out: np.ndarray, seq: int) -> None:
        self._wait(self.bell // 8, seq)
        record = self.mem.words[self.record // 8 : self.record // 8 + RECORD_WORDS].copy()
        if int(record[0]) != seq or int(record[2]) > out.nbytes:
            raise RuntimeError(f"rank {self.mem.rank}: floor record {record} for message {seq}")
        out[: int(record[2])] = self.mine[: int(record[2])]
        self.theirs.view(np.uint64)[self.ack // 8] = seq
        self.mem.win.Sync()

    def _wait(self, word: int, value: int) -> None:
        deadline = time.monotonic() + 60
        while True:
            self.mem.win.Sync()
            if self.mem.words[word] == value:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.mem.rank}: floor word {word} from {self.peer}")
            os.sched_yield()

    def free(self) -> None:
        self.mem.free()
