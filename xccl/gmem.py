"""Die memory: one MPI RMA window per die, the UB-reachable part of its memory.

Every rank allocates its window once (`MPI.Win.Allocate`; host ranks with 0 bytes) inside one
passive-target epoch (`Lock_all`) for the window's life. Put = a write to a peer (MTE3 / DMA),
Get = a pull (MTE2), one-word Accumulate / Fetch_and_op = a flag, Flush = completion.
Bounds are checked here before every RMA call: MPICH does not catch an out-of-window Put, it
corrupts itself (shared/MPI_NOTES.md).

Polling a word of one's own window that a peer writes: on one node the window is shared memory and
a local load after `Win.Sync()` sees the peer's writes; a peer on another node must be progressed
through MPI, so the poll is `Fetch_and_op(NO_OP)` on oneself + `Flush`. The idiom is chosen per
writer ("auto"), or forced for the whole window ("load" / "rma").

Every window counts what crossed nodes (`Traffic`): the cross-node path is the one a real
multi-node pod takes, so the tests that run on two hosts check it was really taken.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from mpi4py import MPI

from xccl.errors import OutOfWindow, XcclTimeout

PollIdiom = Literal["auto", "load", "rma"]
WORD = np.dtype(np.uint64)


@dataclass
class Traffic:
    """What one rank's window did across nodes."""

    remote_polls: int = 0  # polls of a word a writer on another node writes (Fetch_and_op + Flush)
    remote_rma: int = 0  # put / get / word atomics whose target rank is on another node
    remote_bytes: int = 0  # bytes those moved

    def add(self, other: Traffic) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


# Every window this process freed, summed: what a test body reports after its windows are gone.
PROCESS_TRAFFIC = Traffic()


class DieMemory:
    """The window façade: put / get / word atomics / flush / poll / free."""

    def __init__(self, comm: MPI.Comm, nbytes: int, *, poll_idiom: PollIdiom = "auto") -> None:
        if nbytes < 0 or nbytes % WORD.itemsize:
            raise ValueError(f"window size must be a non-negative multiple of 8, got {nbytes}")
        self.comm = comm
        self.rank = comm.rank
        self.nbytes = nbytes
        self.sizes = tuple(comm.allgather(nbytes))
        self.win = MPI.Win.Allocate(nbytes, 1, comm=comm)
        self.win.Lock_all()
        self.local = (
            np.frombuffer(self.win.tomemory(), dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)
        )
        self.local[:] = 0
        self.words = self.local.view(WORD)
        self.floats = self.local.view(np.float64)
        self.is_same_node = _same_node_table(comm)
        if poll_idiom == "load" and not all(self.is_same_node):
            # A local load never sees a write from another node (docs/mpi.md): it would hang.
            far = [r for r, same in enumerate(self.is_same_node) if not same]
            raise ValueError(
                f"rank {self.rank}: poll_idiom 'load' cannot see writes from ranks {far} on "
                "other nodes; use 'auto' or 'rma'"
            )
        self.poll_idiom = poll_idiom
        self._word_buf = np.zeros(1, WORD)
        self._fetch_buf = np.zeros(1, WORD)
        self._claimed: set[str] = set()
        self.traffic = Traffic()
        self.world_traffic: list[Traffic] | None = None  # on rank 0 after free(): every rank's
        comm.Barrier()  # every window zeroed before anyone writes into it

    # -- checks ---------------------------------------------------------------------------------
    def check(self, peer: int, offset: int, nbytes: int, what: str) -> None:
        if not 0 <= peer < len(self.sizes):
            raise OutOfWindow(
                f"die rank {self.rank}: {what} to rank {peer}, but ranks are "
                f"0..{len(self.sizes) - 1}"
            )
        if offset < 0 or nbytes < 0 or offset + nbytes > self.sizes[peer]:
            raise OutOfWindow(
                f"die rank {self.rank}: {what} of {nbytes} B at offset {offset} in "
                f"rank {peer}'s window of {self.sizes[peer]} B"
            )

    def claim(self, region: str) -> None:
        """A protocol claims its region once: a second protocol object on the same region would
        restart its sequence numbers over live records and read stale doorbells."""
        if region in self._claimed:
            raise ValueError(
                f"rank {self.rank}: the window's {region} region is already in use "
                "by another protocol object; create one per window"
            )
        self._claimed.add(region)

    # -- data -----------------------------------------------------------------------------------
    def put(self, peer: int, offset: int, data: np.ndarray) -> None:
        """Write `data` (any contiguous array) at `offset` of `peer`'s window; complete on flush."""
        raw = _as_bytes(data)
        self.check(peer, offset, raw.nbytes, "put")
        self._count(peer, raw.nbytes)
        if raw.nbytes:
            self.win.Put(raw, peer, offset)

    def get(self, peer: int, offset: int, out: np.ndarray) -> None:
        """Read into `out` (contiguous) from `peer`'s window; valid after `flush(peer)`."""
        raw = _as_bytes(out)
        self.check(peer, offset, raw.nbytes, "get")
        self._count(peer, raw.nbytes)
        if raw.nbytes:
            self.win.Get(raw, peer, offset)

    def flush(self, peer: int) -> None:
        self.win.Flush(peer)

    def flush_all(self) -> None:
        self.win.Flush_all()

    # -- words (flags, doorbells) ---------------------------------------------------------------
    def store_word(self, peer: int, offset: int, value: int) -> None:
        """Atomically replace one 64-bit word in `peer`'s window (then flush to complete)."""
        self.check(peer, offset, WORD.itemsize, "store_word")
        self._count(peer, WORD.itemsize)
        self._word_buf[0] = value
        self.win.Accumulate(
            [self._word_buf, 1, MPI.UINT64_T],
            peer,
            target=(offset, 1, MPI.UINT64_T),
            op=MPI.REPLACE,
        )

    def fetch_word(self, peer: int, offset: int) -> int:
        """Atomically read one word of `peer`'s window (Fetch_and_op NO_OP + Flush)."""
        self.check(peer, offset, WORD.itemsize, "fetch_word")
        self._count(peer, WORD.itemsize)
        self.win.Fetch_and_op(
            [self._word_buf, MPI.UINT64_T],
            [self._fetch_buf, MPI.UINT64_T],
            peer,
            offset,
            op=MPI.NO_OP,
        )
        self.win.Flush(peer)
        return int(self._fetch_buf[0])

    def load_word(self, offset: int, writer: int) -> int:
        """Read one word of this die's own window that `writer` writes."""
        idiom = self.poll_idiom
        if idiom == "auto":
            idiom = "load" if self.is_same_node[writer] else "rma"
        if idiom == "rma":
            self.traffic.remote_polls += not self.is_same_node[writer]
            return self.fetch_word(self.rank, offset)
        self.check(self.rank, offset, WORD.itemsize, "load_word")
        self.win.Sync()
        return int(self.words[offset // WORD.itemsize])

    def sync(self) -> None:
        """Memory barrier between RMA writes by peers and local loads of this window."""
        self.win.Sync()

    def _count(self, peer: int, nbytes: int) -> None:
        if not self.is_same_node[peer]:
            self.traffic.remote_rma += 1
            self.traffic.remote_bytes += nbytes

    def free(self) -> None:
        """Release the window (collective); safe to call twice. Rank 0 of the window's
        communicator gets every rank's traffic in `world_traffic` first."""
        if self.win == MPI.WIN_NULL:
            return
        self.world_traffic = self.comm.gather(self.traffic, root=0)
        PROCESS_TRAFFIC.add(self.traffic)
        self.win.Unlock_all()
        self.win.Free()
        self.local = np.zeros(0, np.uint8)
        self.words, self.floats = self.local.view(WORD), self.local.view(np.float64)


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array, as a flat uint8 view (no copy)."""
    if array.dtype == np.uint8 and array.ndim == 1:
        return array
    if not array.flags.c_contiguous:
        raise ValueError(f"RMA buffers must be contiguous, got strides {array.strides}")
    return array.reshape(-1).view(np.uint8)


def poll_until(
    ready: Callable[[], bool],
    *,
    deadline: float,
    describe: Callable[[], str],
    interrupt: Callable[[], None] | None = None,
) -> None:
    """Spin on `ready()` yielding the CPU between tries; raise XcclTimeout after `deadline`.

    `interrupt` is called between tries (e.g. to raise a rollback signal) so no wait is deaf.
    """
    while not ready():
        if interrupt is not None:
            interrupt()
        if time.monotonic() > deadline:
            raise XcclTimeout(describe())
        os.sched_yield()


def _same_node_table(comm: MPI.Comm) -> tuple[bool, ...]:
    """For each rank of `comm`: does it share this rank's node (and so its memory)?"""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leader = node.allreduce(comm.rank, op=MPI.MIN)
    node.Free()
    leaders = comm.allgather(leader)
    return tuple(other == leader for other in leaders)
