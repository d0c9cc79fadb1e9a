"""One record slot used again and again (p2p's ring records): records.py's publish / read rules,
with the path, the bounds check and the offsets settled once when the slot is bound.

A p2p pair writes the same RECORDS_PER_PAIR slots for every publication, so per publication
only the values change. On the load/store path `OutRecord.publish` assigns the body straight
into the reader's memory (one structured store), then `Win.Sync`, the one-word doorbell,
`Win.Sync`; on RMA it stages the body, Puts it, flushes, rings the doorbell with one Accumulate
and flushes again: the order of `records.publish` on both paths (docs/mpi.md §2).
`InRecord.has_rung` polls the doorbell with the writer's idiom (`DieMemory.word_loader`), and
`InRecord.read` does `Win.Sync` before it loads the body, as `records.read` does.
Valid until the window is freed.
"""

from __future__ import annotations

import numpy as np

from xccl.gmem import WORD, DieMemory
from xccl.layout import RECORD_BYTES
from xccl.records.record import (
    BODY_OFFSET,
    DOORBELL_OFFSET,
    RecordAt,
    event_mismatch,
    put_bytes,
)


def body_dtype(dtype: np.dtype) -> np.dtype:
    """`dtype` without its doorbell: the fields a publication writes before ringing."""
    names = [name for name in dtype.names if name != "doorbell"]
    return np.dtype(
        {
            "names": names,
            "formats": [dtype.fields[name][0] for name in names],
            "offsets": [dtype.fields[name][1] for name in names],
            "itemsize": RECORD_BYTES,
        }
    )


class OutRecord:
    """The writer's end of the record at `at` (in `at.peer`'s window)."""

    def __init__(self, mem: DieMemory, at: RecordAt, dtype: np.dtype) -> None:
        self.mem, self.at = mem, at
        self._end = put_bytes(dtype)
        region = mem.region(at.peer, at.offset, RECORD_BYTES)
        # Load/store: the body's fields over the reader's memory, and its doorbell word.
        self._body = None if region is None else region.view(body_dtype(dtype))
        self._bell = None if region is None else region[DOORBELL_OFFSET:BODY_OFFSET].view(WORD)
        self._staged = np.zeros(1, body_dtype(dtype))  # RMA: the body Put from here
        self._staged_bytes = self._staged.view(np.uint8)[BODY_OFFSET : self._end]

    def publish(self, values: tuple, doorbell: int) -> None:
        """Write the body (`values` in field order, doorbell excluded), a barrier, then ring."""
        mem, peer = self.mem, self.at.peer
        if self._body is not None:
            self._body[0] = values
            mem.sync()  # the body before the doorbell
            self._bell[0] = doorbell  # one aligned 8-byte store: atomic
            mem.sync()
            mem.wake_words.wake([peer])
            return
        self._staged[0] = values
        mem.put(peer, self.at.offset + BODY_OFFSET, self._staged_bytes)
        mem.flush(peer)
        mem.store_word(peer, self.at.offset + DOORBELL_OFFSET, doorbell)
        mem.flush(peer)  # the word buffer is reused by the next store
        mem.wake_words.wake([peer])


class InRecord:
    """The reader's end of the record at `at` (in this die's window, written by `at.peer`)."""

    def __init__(self, mem: DieMemory, at: RecordAt, dtype: np.dtype) -> None:
        self.mem, self.at = mem, at
        self.has_doorbell = mem.word_loader(at.offset + DOORBELL_OFFSET, at.peer)
        self._record = mem.local[at.offset : at.offset + RECORD_BYTES].view(dtype)

    def has_rung(self, doorbell: int) -> bool:
        return self.has_doorbell() == doorbell

    def read(self, stage: str, event_id: int, call: str) -> tuple:
        """The record's fields as a tuple in field order (doorbell first), after a barrier;
        EventMismatch if it carries another event than `event_id` (`stage`, `call`: as in
        records.Expected, for the message)."""
        self.mem.sync()  # the writer's body, written before its doorbell, becomes visible
        values = self._record.item(0)
        if values[1] != event_id:
            raise event_mismatch(self.mem.rank, stage, event_id, call, self.at.peer, values[1])
        return values
