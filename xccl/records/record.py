"""The metadata record and its writer's end (xDeepServe §3): what a record is, and the one order
every protocol publishes it in.

A record is RECORD_BYTES in the reader's window, written by one peer: word 0 is the doorbell, the
rest the body, named fields of a numpy structured dtype (the paper's 32-byte field, plus the
doorbell, the writer's virtual time and sizes):
    P2P_RECORD   p2p (xccl/p2p/channel.py): chunk id, tail pointer, message and publication sizes,
    cores
    ROWS_RECORD  dispatch/combine and A2E/E2A (xccl/ep/buffer.py, xccl/afd/buffer.py): rows and
    where they sit
Publishing: Put every body, flush, then ring each doorbell with the publication number and flush,
so a reader that sees the number never acts on a half-written body (shared/MPI_NOTES.md); then
wake the readers asleep in their wait (xccl/wake.py). The reader's end, the doorbell waits and the
body reads, is xccl/records/wait.py.

Three writers keep that order (docs/mpi.md §2):
  publish   any list of records, settled on every call (path, bounds, offsets);
  OutRecord one slot used again and again (p2p's ring records), settled once: on load/store its
            body is one structured store into the reader's memory, then `Win.Sync`, the doorbell,
            `Win.Sync`; on RMA a staged Put, flush, one Accumulate, flush;
  FanOut    one slot per reader written every call (dispatch/combine, the agreement), bound once:
            per publication a Put, a doorbell store and a barrier per member would be ~200
            window calls per dispatch at 64 dies; bound, the near readers' bodies and doorbells
            are plain stores with one barrier after the bodies and one after the doorbells.
Bound writers are valid until the window is freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from xccl.gmem import WORD, DieMemory
from xccl.layout import RECORD_BYTES


def _record_dtype(fields: list[tuple[str, str]]) -> np.dtype:
    """doorbell, event_id, then `fields`, packed in order and padded to RECORD_BYTES."""
    names, formats = zip(("doorbell", "<u8"), ("event_id", "<u8"), *fields)
    return np.dtype({"names": list(names), "formats": list(formats), "itemsize": RECORD_BYTES})


# chunk_id: ring slots before this publication in its message; tail: the sender's tail pointer
# after it; msg_bytes / pub_bytes: sizes of the message and of this publication; num_cores /
# is_dma: how the sender wrote the bytes (the receiver prices the same transfer); kind: P2P_RING,
# P2P_RTS or P2P_DIRECT (xccl/p2p/send.py).
P2P_RECORD = _record_dtype(
    [
        ("chunk_id", "<u8"),
        ("tail", "<u8"),
        ("vtime_ns", "<f8"),
        ("msg_bytes", "<u8"),
        ("pub_bytes", "<u8"),
        ("num_cores", "<u4"),
        ("is_dma", "<u2"),
        ("kind", "<u2"),
    ]
)
P2P_RING, P2P_RTS, P2P_DIRECT = 0, 1, 2
# count / offset: rows the writer staged for the reader and the row where they start;
# shared_count / shared_offset: its full-precision shared-expert rows (A2E/E2A only, else 0).
ROWS_RECORD = _record_dtype(
    [
        ("count", "<u8"),
        ("offset", "<u8"),
        ("vtime_ns", "<f8"),
        ("shared_count", "<u8"),
        ("shared_offset", "<u8"),
    ]
)
DOORBELL_OFFSET = 0
BODY_OFFSET = 8
# p2p's ack is one atomic word, not a record: the publication number (16 bits, compared modulo
# 2^16) and the receiver's virtual time in ns (48 bits, 78 virtual hours).
ACK_SEQ_BITS, ACK_TIME_BITS = 16, 48


@cache
def put_bytes(dtype: np.dtype) -> int:
    """Bytes a publication writes: the doorbell and the body's fields (not the padding)."""
    return max(offset + field.itemsize for field, offset in dtype.fields.values())


@dataclass(frozen=True)
class RecordAt:
    """One record: `peer` is the die at the other end (the target when publishing, the writer
    when reading); `offset` its byte offset in the window that holds it."""

    peer: int
    offset: int


def publish(mem: DieMemory, records: Sequence[RecordAt], bodies: np.ndarray, doorbell: int) -> None:
    """Put bodies[i] (every field after the doorbell) into records[i], flush, then ring each
    doorbell with `doorbell` and flush. The Puts read `bodies` until that first flush."""
    raw = bodies.view(np.uint8).reshape(len(bodies), RECORD_BYTES)
    end = put_bytes(bodies.dtype)
    for record, row in zip(records, raw):
        mem.put(record.peer, record.offset + BODY_OFFSET, row[BODY_OFFSET:end])
    if len(records) == 1:
        mem.flush(records[0].peer)
    else:
        mem.flush_all()
    for record in records:
        mem.store_word(record.peer, record.offset + DOORBELL_OFFSET, doorbell)
        mem.flush(record.peer)  # the word buffer is reused by the next store
    mem.wake_words.wake([record.peer for record in records])  # readers asleep in wait()


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


def ack_word(seq: int, vtime_ns: float = 0.0) -> int:
    """The ack of publication `seq`, written at virtual time `vtime_ns`."""
    return (seq % (1 << ACK_SEQ_BITS)) << ACK_TIME_BITS | (
        int(vtime_ns) & ((1 << ACK_TIME_BITS) - 1)
    )


def ack_covers(word: int, seq: int) -> bool:
    """Does the ack `word` acknowledge publication `seq`? Numbers wrap at 16 bits; with so few
    publications in flight, "acked >= seq" modulo 2^16 is exact."""
    return ((word >> ACK_TIME_BITS) - seq) % (1 << ACK_SEQ_BITS) < 1 << (ACK_SEQ_BITS - 1)


def ack_time_ns(word: int) -> float:
    return float(word & ((1 << ACK_TIME_BITS) - 1))
