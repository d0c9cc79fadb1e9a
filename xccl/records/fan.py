"""One record per member, written and read every call (dispatch/combine, the agreement), bound
once.

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

from xccl.gmem import WORD, DieMemory
from xccl.layout import RECORD_BYTES
from xccl.records import record as records
from xccl.records.record import BODY_OFFSET, DOORBELL_OFFSET, Expected, RecordAt, put_bytes
from xccl.records.word_poll import WordPoll
from xccl.recovery.faults import Interrupt


class FanOut:
    """This die's slot in each of `targets` (one per reader, `slot_bytes` at `at.offset`): the
    body bytes [body_at, body_at + body_bytes) written first, then the one-word doorbell at
    `bell_at`. `FanOut.records` binds records (the doorbell first, then the body)."""

    def __init__(
        self,
        mem: DieMemory,
        targets: Sequence[RecordAt],
        *,
        slot_bytes: int,
        body_at: int,
        body_bytes: int,
        bell_at: int,
    ) -> None:
        self.mem, self.targets = mem, list(targets)
        self.peers = [at.peer for at in self.targets]
        self._body = slice(body_at, body_at + body_bytes)
        self._bell_at = bell_at
        self._near: list[tuple[int, np.ndarray]] = []  # (i, the body's bytes in reader i)
        self._bells: list[np.ndarray] = []  # [1] uint64 doorbells of the near readers
        self._far: list[tuple[int, RecordAt]] = []  # (i, a reader reached by RMA)
        for i, at in enumerate(self.targets):
            region = mem.region(at.peer, at.offset, slot_bytes)
            if region is None:
                self._far.append((i, at))
            else:
                self._near.append((i, region[self._body]))
                self._bells.append(region[bell_at : bell_at + WORD.itemsize].view(WORD))

    @classmethod
    def records(cls, mem: DieMemory, targets: Sequence[RecordAt], dtype: np.dtype) -> FanOut:
        """A record of `dtype` in each of `targets`: its fields after the doorbell, then it."""
        body_bytes = put_bytes(dtype) - BODY_OFFSET
        return cls(
            mem,
            targets,
            slot_bytes=RECORD_BYTES,
            body_at=BODY_OFFSET,
            body_bytes=body_bytes,
            bell_at=DOORBELL_OFFSET,
        )

    def publish(self, slots: np.ndarray, doorbell: int) -> None:
        """slots: [len(targets), slot bytes] uint8, target i's slot in row i (only the body
        bytes are sent), or [slot bytes] for every target alike. Every body, a barrier, then
        every doorbell rung with `doorbell`, a barrier; sleeping readers woken."""
        mem, body = self.mem, self._body
        every = slots[body] if slots.ndim == 1 else None
        for i, dst in self._near:
            dst[:] = slots[i, body] if every is None else every
        for i, at in self._far:  # Puts read `slots` until the flush
            data = slots[i, body] if every is None else every
            mem.put(at.peer, at.offset + body.start, data)
        if self._far:
            mem.flush_all()  # Flush_all, then the Win.Sync the near bodies need
        else:
            mem.sync()  # the bodies before the doorbells
        for bell in self._bells:
            bell[0] = doorbell  # one aligned 8-byte store: atomic
        for _, at in self._far:
            mem.store_word(at.peer, at.offset + self._bell_at, doorbell)
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
