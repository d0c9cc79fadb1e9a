"""Die memory: one MPI RMA window per die, the UB-reachable part of its memory.

Every rank allocates its window once (`MPI.Win.Allocate`; host ranks with 0 bytes) inside one
passive-target epoch (`Lock_all`) for the window's life. Put = a write to a peer (MTE3 / DMA),
Get = a pull (MTE2), one-word Accumulate / Fetch_and_op = a flag, Flush = completion.
Bounds are checked here before every RMA call: MPICH does not catch an out-of-window Put, it
corrupts itself (docs/mpi.md §2).

Each peer is reached by plain loads and stores into its memory when `Shared_query` exposes it
(same node), else by RMA; xccl/gmem_paths.py chooses per peer at creation. The ordering rules
(docs/mpi.md §2, "Load/store path") hold on both paths: a writer's data stores/Puts, then
`flush` (a `Win.Sync` memory barrier on the load/store path, `Win.Flush` on RMA), then the
one-word doorbell (one aligned 8-byte store, or an Accumulate), then `flush` again; a reader
loads the doorbell, `Win.Sync`, then reads the data.

Polling a word of one's own window that a peer writes: on one node the window is shared memory and
a local load after `Win.Sync()` sees the peer's writes; a peer on another node must be progressed
through MPI, so the poll is `Fetch_and_op(NO_OP)` on oneself + `Flush`. The idiom is chosen per
writer ("auto"), or forced for the whole window ("load" / "rma").

Every window counts what crossed nodes (`Traffic`): the cross-node path is the one a real
multi-node pod takes, so the tests that run on two hosts check it was really taken.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from mpi4py import MPI

from xccl.errors import OutOfWindow
from xccl.gmem_paths import (
    MemoryPath,
    check_memory_path,
    default_memory_path,
    describe_paths,
    known_node_leader,
    peer_views,
    same_node_table,
)
from xccl.wake import WakeWords, quiet_barrier, timed

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

    def __init__(
        self,
        comm: MPI.Comm,
        nbytes: int,
        *,
        poll_idiom: PollIdiom = "auto",
        memory_path: MemoryPath | None = None,
        unzeroed: Sequence[tuple[int, int]] = (),
        wakes: bool = True,
    ) -> None:
        """unzeroed: (offset, nbytes) regions always written before they are read (row
        staging): left as the MPI gave them, so that their pages are not touched at start (at
        ep288, zeroing every window committed 10 GiB of shared memory before the first token).
        wakes: waits on this window may sleep until a writer wakes them (xccl/wake.py); False
        for words no wait of xccl/wake.py reads (the abort words of xccl/recovery/rollback.py):
        no wake words' window is made (the same on every rank: it is collective)."""
        if nbytes < 0 or nbytes % WORD.itemsize:
            raise ValueError(f"window size must be a non-negative multiple of 8, got {nbytes}")
        self.comm = comm
        self.rank = comm.rank
        self.nbytes = nbytes
        quiet_barrier(comm, what="window allocation")  # the ranks built at different times
        # Without wake words of its own (wakes False), the window meets at its free on those of
        # another live window over the same ranks, when every rank has one (`meet`).
        other = None if wakes else _wake_words_over(comm)
        peers = comm.allgather((nbytes, known_node_leader(), other is not None))
        self.sizes = tuple(size for size, _, _ in peers)
        self._meets_on = other if all(has for _, _, has in peers) else None
        self.win = MPI.Win.Allocate(nbytes, 1, comm=comm)
        self.win.Lock_all()
        self._win = timed(self.win)  # every data, flag and sync call goes through it
        self.local = (
            np.frombuffer(self.win.tomemory(), dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)
        )
        self._zero_except(unzeroed)
        self.words = self.local.view(WORD)
        self.floats = self.local.view(np.float64)
        self.is_same_node = same_node_table(comm, [node for _, node, _ in peers])
        self.memory_path = check_memory_path(memory_path or default_memory_path())
        # Per peer: its window as a load/store array, or None (RMA); and its words.
        self.views = peer_views(self.win, self.sizes, self.is_same_node, self.memory_path)
        self._view_words = tuple(None if v is None else v.view(WORD) for v in self.views)
        self._has_rma_peer = any(v is None for v in self.views)
        self._has_far_peer = not all(self.is_same_node)
        # Sleeping waits on this node (xccl/wake.py): every rank's wake words, their own
        # window;
        # writers call wake_words.wake after ringing doorbells, waits park in wake_words.sleeper.
        self.wake_words = WakeWords(
            comm,
            lambda win, sizes: peer_views(win, sizes, self.is_same_node, self.memory_path),
            needed=wakes,
        )
        if self.wake_words.win is not None:
            _WITH_WAKE_WORDS.append(weakref.ref(self))
        if poll_idiom == "load" and not all(self.is_same_node):
            # A local load never sees a write from another node (docs/mpi.md): it would hang.
            far = [r for r, same in enumerate(self.is_same_node) if not same]
            raise ValueError(
                f"rank {self.rank}: poll_idiom 'load' cannot see writes from ranks {far} on "
                "other nodes; use 'auto' or 'rma'"
            )
        self.poll_idiom = poll_idiom
        # Per writer: poll through MPI (a far writer, or forced) or by a local load.
        self.poll_by_rma = tuple(
            poll_idiom == "rma" or (poll_idiom == "auto" and not same) for same in self.is_same_node
        )
        self._word_buf = np.zeros(1, WORD)
        self._fetch_buf = np.zeros(1, WORD)
        self._claimed: set[str] = set()
        self.traffic = Traffic()
        self.world_traffic: list[Traffic] | None = None  # on rank 0 after free(): every rank's
        comm.Barrier()  # every window zeroed before anyone writes into it

    # -- checks ---------------------------------------------------------------------------------
    def _zero_except(self, unzeroed: Sequence[tuple[int, int]]) -> None:
        """Zero the window but the `unzeroed` regions (records and doorbells start at 0)."""
        at = 0
        for offset, size in sorted(unzeroed):
            if not 0 <= at <= offset <= offset + size <= self.nbytes:
                raise ValueError(f"unzeroed region ({offset}, {size}) outside or overlapping")
            self.local[at:offset] = 0
            at = offset + size
        self.local[at:] = 0

    def check(self, peer: int, offset: int, nbytes: int, what: str) -> None:
        sizes = self.sizes
        if 0 <= peer < len(sizes) and 0 <= offset and 0 <= nbytes <= sizes[peer] - offset:
            return
        if not 0 <= peer < len(sizes):
            raise OutOfWindow(
                f"die rank {self.rank}: {what} to rank {peer}, but ranks are 0..{len(sizes) - 1}"
            )
        raise OutOfWindow(
            f"die rank {self.rank}: {what} of {nbytes} B at offset {offset} in "
            f"rank {peer}'s window of {sizes[peer]} B"
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
        raw = as_bytes(data)
        self.check(peer, offset, raw.nbytes, "put")
        self._count(peer, raw.nbytes)
        view = self.views[peer]
        if view is not None:
            view[offset : offset + raw.nbytes] = raw
        elif raw.nbytes:
            self._win.Put(raw, peer, offset)

    def get(self, peer: int, offset: int, out: np.ndarray) -> None:
        """Read into `out` (contiguous) from `peer`'s window; valid after `flush(peer)`."""
        raw = as_bytes(out)
        self.check(peer, offset, raw.nbytes, "get")
        self._count(peer, raw.nbytes)
        view = self.views[peer]
        if view is not None:
            raw[:] = view[offset : offset + raw.nbytes]
        elif raw.nbytes:
            self._win.Get(raw, peer, offset)

    def flush(self, peer: int) -> None:
        """Complete this die's writes to `peer`: on the load/store path the memory barrier
        that orders them before the next store (the doorbell), on RMA `Win.Flush`."""
        if self.views[peer] is not None:
            self._win.Sync()
        else:
            self._win.Flush(peer)

    def flush_all(self) -> None:
        if self._has_rma_peer:
            self._win.Flush_all()
        self._win.Sync()

    # -- words (flags, doorbells) ---------------------------------------------------------------
    def store_word(self, peer: int, offset: int, value: int) -> None:
        """Atomically replace one 64-bit word in `peer`'s window (then flush to complete)."""
        self.check(peer, offset, WORD.itemsize, "store_word")
        self._count(peer, WORD.itemsize)
        words = self._view_words[peer]
        if words is not None:
            words[offset // WORD.itemsize] = value  # one aligned 8-byte store: atomic
            return
        self._word_buf[0] = value
        self._win.Accumulate(
            [self._word_buf, 1, MPI.UINT64_T],
            peer,
            target=(offset, 1, MPI.UINT64_T),
            op=MPI.REPLACE,
        )

    def fetch_word(self, peer: int, offset: int) -> int:
        """Atomically read one word of `peer`'s window: Win.Sync + one aligned load on the
        load/store path, Fetch_and_op NO_OP + Flush on RMA."""
        self.check(peer, offset, WORD.itemsize, "fetch_word")
        self._count(peer, WORD.itemsize)
        words = self._view_words[peer]
        if words is not None:
            self._win.Sync()
            return int(words[offset // WORD.itemsize])
        return self._rma_fetch(peer, offset)

    def _rma_fetch(self, peer: int, offset: int) -> int:
        self._win.Fetch_and_op(
            [self._word_buf, MPI.UINT64_T],
            [self._fetch_buf, MPI.UINT64_T],
            peer,
            offset,
            op=MPI.NO_OP,
        )
        self._win.Flush(peer)
        return int(self._fetch_buf[0])

    def serve_far_peers(self) -> None:
        """Step into MPI once so that dies on other nodes can finish their RMA on this window;
        nothing when every peer is on this node.

        Across nodes a window moves only while its owner is inside MPI (docs/mpi.md). A die
        whose wait polls by local loads (every writer it waits for is on its node) or sleeps
        is outside MPI, so a far die pulling from its window (a Get and its Flush) or writing a
        record it does not poll yet waits on it; when that far die is what the local writers
        wait for, nobody moves (afd_pod on two hosts: attention dies waiting for their E2A
        from a trampoline on their node, while the expert dies on the other host waited in
        the Flush of their A2E pulls from those same attention dies). Every wait calls this
        between tries: one Fetch_and_op on oneself and its Flush, the far poll's idiom."""
        if self._has_far_peer:
            self._rma_fetch(self.rank, 0)

    @property
    def far_server(self) -> Callable[[], None] | None:
        """`serve_far_peers` for a wait's `serve`, or None when every peer is on this node (a
        call less per try of every wait)."""
        return self.serve_far_peers if self._has_far_peer else None

    def load_word(self, offset: int, writer: int) -> int:
        """Read one word of this die's own window that `writer` writes."""
        if self.poll_by_rma[writer]:
            # Through MPI even on the load/store path: only that progresses a far writer.
            self.traffic.remote_polls += not self.is_same_node[writer]
            self.check(self.rank, offset, WORD.itemsize, "load_word")
            return self._rma_fetch(self.rank, offset)
        self.check(self.rank, offset, WORD.itemsize, "load_word")
        self._win.Sync()
        return int(self.words[offset // WORD.itemsize])

    # -- settled once, for places a protocol writes and polls again and again -------------------
    def region(self, peer: int, offset: int, nbytes: int) -> np.ndarray | None:
        """`peer`'s window bytes [offset, offset + nbytes) as a uint8 array for plain loads and
        stores, bounds checked here once; None when `peer` is reached by RMA (use put / get)."""
        self.check(peer, offset, nbytes, "region")
        view = self.views[peer]
        return None if view is None else view[offset : offset + nbytes]

    def word_loader(self, offset: int, writer: int) -> Callable[[], int]:
        """`load_word(offset, writer)` for a word polled again and again: the bounds check and
        the idiom (a far writer is polled through MPI) are settled here once."""
        self.check(self.rank, offset, WORD.itemsize, "load_word")
        if self.poll_by_rma[writer]:
            return lambda: self.load_word(offset, writer)
        words, index, sync = self.words, offset // WORD.itemsize, self._win.Sync

        def load() -> int:
            sync()
            return int(words[index])

        return load

    def describe_paths(self) -> str:
        """Which path reaches which peer, e.g. 'load/store to ranks [0, 1], rma to ranks [2]'."""
        return describe_paths(self.views)

    def sync(self) -> None:
        """Memory barrier between RMA writes by peers and local loads of this window."""
        self._win.Sync()

    def _count(self, peer: int, nbytes: int) -> None:
        if not self.is_same_node[peer]:
            self.traffic.remote_rma += 1
            self.traffic.remote_bytes += nbytes

    def meet(self, *, what: str, timeout_s: float = 600.0) -> None:
        """Every rank of the window's communicator here, none polling meanwhile (collective):
        on the wake words where every rank reaches them (`WakeWords.gather`), else a dozing
        Ibarrier (`quiet_barrier`). Before a blocking collective the ranks reach at different
        times (MPICH polls those at full speed)."""
        words = self.wake_words if self._meets_on is None else self._meets_on.wake_words
        if not words.gather(what=what, timeout_s=timeout_s):
            quiet_barrier(self.comm, what=what, timeout_s=timeout_s)

    def free(self) -> None:
        """Release the window (collective); safe to call twice. Rank 0 of the window's
        communicator gets every rank's traffic in `world_traffic` first."""
        if self.win == MPI.WIN_NULL:
            return
        self.meet(what="window free")  # the ranks end at different times
        self.world_traffic = self.comm.gather(self.traffic, root=0)
        PROCESS_TRAFFIC.add(self.traffic)
        self.win.Unlock_all()
        self.win.Free()
        # The ranks leave the data window's Free at different times, and the wake words' Free
        # is another blocking collective that MPICH polls at full speed: they meet first
        # (docs/scale.md, the stop).
        if self.wake_words.win is not None:  # alike on every rank (WakeWords)
            self.meet(what="wake words free")
        self.wake_words.free()
        self.views = (None,) * len(self.sizes)  # the peers' memory is gone with the window
        self._view_words = self.views
        self.local = np.zeros(0, np.uint8)
        self.words, self.floats = self.local.view(WORD), self.local.view(np.float64)


# The live windows with wake words of this process, in the order they were made (the same on
# every rank: windows are made collectively).
_WITH_WAKE_WORDS: list[weakref.ref] = []


def _wake_words_over(comm: MPI.Comm) -> DieMemory | None:
    """The first live window with wake words over the ranks of `comm`, in their order, whose
    every rank's words this process reaches, or None. A window freed later than the one that
    borrows it (a die frees its abort words before its data window; the TE-shell its fence
    window before its own)."""
    _WITH_WAKE_WORDS[:] = [ref for ref in _WITH_WAKE_WORDS if ref() is not None]
    for ref in _WITH_WAKE_WORDS:
        mem = ref()
        if mem is not None and mem.wake_words.reach_every_rank:
            if MPI.Group.Compare(mem.comm.group, comm.group) == MPI.IDENT:
                return mem
    return None


def as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array, as a flat uint8 view (no copy)."""
    if array.dtype == np.uint8 and array.ndim == 1:
        return array
    if not array.flags.c_contiguous:
        raise ValueError(f"RMA buffers must be contiguous, got strides {array.strides}")
    return array.reshape(-1).view(np.uint8)
