"""The raw baselines of `xds-mpi bench p2p` (launch/bench/p2p.py), one pair's end each:
  put      - MPI Put of the data + Flush + a one-word flag + Flush; the peer polls the flag
  ls       - numpy stores into the peer's window (Shared_query), Win.Sync, a one-word flag store;
             the peer polls Win.Sync + a load of the flag
  sendrecv - two-sided MPI Send/Recv of the same bytes
A one-way variant sends the data one way and only the flag back (an ack, like XCCL's).
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from xccl.gmem import DieMemory
from xccl.wake import poll_until


class RawPair:
    """One rank's end of the raw ping-pongs with `peer`; messages of up to `max_bytes`."""

    def __init__(self, comm: MPI.Comm, peer: int, max_bytes: int) -> None:
        nbytes = (max_bytes + 64 + 7) // 8 * 8  # data + a flag word
        self.comm, self.peer, self.is_a = comm, peer, comm.rank % 2 == 0
        self.rma = DieMemory(comm, nbytes, memory_path="rma")
        self.shared = DieMemory(comm, nbytes, memory_path="auto")
        self.flag, self._tokens = self.rma.nbytes - 8, {"put": 0, "ls": 0}

    def _next_token(self, kind: str) -> int:
        """A flag value never used before (a stale equal one would pass a wait; both ranks of a
        pair count alike). Even: the answer sets bit 0."""
        self._tokens[kind] += 1
        return self._tokens[kind] << 1

    def put_rtt(self, buf: np.ndarray, one_way: bool = False) -> None:
        raw, peer, flag = self.rma, self.peer, self.flag
        token = self._next_token("put")

        def put_and_flag(value: int) -> None:
            raw.put(peer, 0, buf)
            raw.flush(peer)
            raw.store_word(peer, flag, value)
            raw.flush(peer)

        def wait_flag(value: int) -> None:
            poll_until(
                lambda: raw.load_word(flag, peer) == value,
                deadline=time.monotonic() + 60,
                describe=lambda: f"rank {self.comm.rank}: bench flag {value} from {peer}",
            )

        if self.is_a:
            put_and_flag(token)
            wait_flag(token | 1)
        else:
            wait_flag(token)
            if one_way:  # only the flag goes back: an ack, like xccl's
                raw.store_word(peer, flag, token | 1)
                raw.flush(peer)
            else:
                put_and_flag(token | 1)

    def ls_rtt(self, buf: np.ndarray, one_way: bool = False) -> None:
        """The raw load/store ping-pong: no DieMemory call, only numpy and Win.Sync."""
        win, peer = self.shared.win, self.peer
        theirs, mine = self.shared.views[peer], self.shared.words
        flag = self.flag // 8
        their_words = theirs.view(np.uint64)
        token = self._next_token("ls")

        def store_and_flag(value: int, data: bool = True) -> None:
            if data:
                theirs[: buf.nbytes] = buf
                win.Sync()  # the data before the flag (docs/mpi.md §2)
            their_words[flag] = value

        def wait_flag(value: int) -> None:
            deadline = time.monotonic() + 60
            while True:
                win.Sync()
                if mine[flag] == value:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.comm.rank}: bench flag {value} from {peer}")
                os.sched_yield()

        if self.is_a:
            store_and_flag(token)
            wait_flag(token | 1)
        else:
            wait_flag(token)
            store_and_flag(token | 1, data=not one_way)

    def sendrecv_rtt(self, buf: np.ndarray) -> None:
        if self.is_a:
            self.comm.Send(buf, self.peer, 5)
            self.comm.Recv(buf, self.peer, 5)
        else:
            self.comm.Recv(buf, self.peer, 5)
            self.comm.Send(buf, self.peer, 5)

    def free(self) -> None:
        self.rma.free()
        self.shared.free()
