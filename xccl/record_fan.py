"""One record per member, written and read every call (dispatch/combine), bound once.

`records.publish` and `records.wait` take any list of records and settle each one's path,
bounds and offsets on every call: per publication a Put, a doorbell store and a barrier per
member, and per wait a fresh `WordPoll`. At 64 dies that is ~200 window calls per dispatch. A
dispatch or combine writes the same records every call (only the values change), so `FanOut`
binds the writer's ends once (load/store: byte views of each reader's record body and its
doorbell word; RMA: the Puts and atomics of `records.publish`) and `FanIn` the reader's (the
doorbells polled together, the bodies one copy when they sit side by side, as the EP layout
puts them). The order is `records.publish`'s: every body, one barrier, every doorbell, one
barrier (docs/mpi.md §2). Valid until the window is freed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xccl import records
from xccl.faults import Interrupt
from xccl.gmem import WORD, DieMemory
from xccl.layout import RECORD_BYTES
from xccl.records import BODY_OFFSET, DOORBELL_OFFSET, Expected, RecordAt, put_bytes
from xccl.word_poll import WordPoll


class FanOut:
    """This die's record in each of `targets` (one per reader; target i gets bodies[i])."""

    def __init__(self, mem: DieMemory, targets: Sequence[RecordAt], dtype: np.dtype) -> None:
        self.mem, self.targets = mem, list(targets)
        self.peers = [at.peer for at in self.targets]
        self._end = put_bytes(dtype)
        self._near: list[tuple[int, np.ndarray]] = []  # (i, the body's bytes in reader i)
        self._bells: list[np.ndarray] = []  # [1] uint64 doorbells of the near readers
        self._far: list[RecordAt] = []  # readers reached by RMA
        self._far_idx: list[int] = []
        for i, at in enumerate(self.targets):
            region = mem.region(at.peer, at.offset, RECORD_BYTES)
            if region is None:
                self._far.append(at)
                self._far_idx.append(i)
            else:
                self._near.append((i, region[BODY_OFFSET : self._end]))
                self._bells.append(region[DOORBELL_OFFSET:BODY_OFFSET].view(WORD))

    def publish(self, bodies: np.ndarray, doorbell: int) -> None:
        """bodies: [len(targets)] record dtype (its doorbell field unused). Every body, a
        barrier, then every doorbell rung with `doorbell`, a barrier; sleeping readers woken."""
        mem, end = self.mem, self._end
        raw = bodies.view(np.uint8).reshape(len(self.targets), RECORD_BYTES)
        for i, body in self._near:
            body[:] = raw[i, BODY_OFFSET:end]
        for i, at in zip(self._far_idx, self._far):  # Puts read `bodies` until the flush
            mem.put(at.peer, at.offset + BODY_OFFSET, raw[i, BODY_OFFSET:end])
        if self._far:
            mem.flush_all()  # Flush_all, then the Win.Sync the near bodies need
        else:
            mem.sync()  # the bodies before the doorbells
        for bell in self._bells:
            bell[0] = doorbell  # one aligned 8-byte store: atomic
        for at in self._far:
            mem.store_word(at.peer, at.offset + DOORBELL_OFFSET, doorbell)
            mem.flush(at.peer)  # the word buffer is reused by the next store
        if self._bells:
            mem.sync()
        mem.wake_words.wake(self.peers)  # readers asleep in their wait


class FanIn:
    """The records `sources` in this die's window, each written by its peer."""

    def __init__(self, mem: DieMemory, sources: Sequence[RecordAt], dtype: np.dtype) -> None:
        self.mem, self.sources, self.dtype = mem, list(sources), dtype
        self.poll = WordPoll(
            mem,
            [at.offset + DOORBELL_OFFSET for at in self.sources],
            [at.peer for at in self.sources],
        )
        offsets = np.array([at.offset for at in self.sources], np.int64)
        self._block = None  # the records side by side: one view over all of them
        if len(offsets) and (np.diff(offsets) == RECORD_BYTES).all():
            first, nbytes = int(offsets[0]), len(offsets) * RECORD_BYTES
            mem.check(mem.rank, first, nbytes, "read")
            self._block = mem.local[first : first + nbytes]

    def wait(
        self, expected: Expected, *, timeout_s: float, interrupt: Interrupt | None
    ) -> np.ndarray:
        """`records.wait` on the bound records: the bodies [len(sources)] once every doorbell
        rang; PeerTimeout naming the missing peers, EventMismatch on a foreign event."""
        mem = self.mem
        records.await_doorbells(
            mem, self.sources, self.poll, expected, timeout_s=timeout_s, interrupt=interrupt
        )
        if self._block is None:
            return records.read(mem, self.sources, expected, self.dtype)
        mem.sync()  # the peers' bodies, written before their doorbells, become visible
        bodies = self._block.copy().view(self.dtype)
        records.check_events(mem, self.sources, expected, bodies)
        return bodies
