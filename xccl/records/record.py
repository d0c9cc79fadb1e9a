"""The metadata record and the one way every protocol publishes and reads it (xDeepServe §3).

A record is RECORD_BYTES in the reader's window, written by one peer: word 0 is the doorbell, the
rest the body, named fields of a numpy structured dtype (the paper's 32-byte field, plus the
doorbell, the writer's virtual time and sizes):
    P2P_RECORD   p2p (xccl/p2p/channel.py): chunk id, tail pointer, message and publication sizes,
    cores
    ROWS_RECORD  dispatch/combine and A2E/E2A (xccl/ep/buffer.py, xccl/afd/buffer.py): rows and
    where they sit
publish: Put every body, flush, then ring each doorbell with the publication number and flush,
so a reader that sees the number never acts on a half-written body (shared/MPI_NOTES.md).
ready: every doorbell rang, then Win.Sync and read the bodies, refusing a stale or misrouted
event id. wait: ready polled until a deadline; the timeout names die, stage, event, call and the
peers whose records are missing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from xccl.errors import EventMismatch, PeerTimeout, RollbackRequested, XcclTimeout
from xccl.gmem import DieMemory
from xccl.layout import RECORD_BYTES
from xccl.records.mpi_time import poll_until
from xccl.records.word_poll import WordPoll
from xccl.recovery.faults import Interrupt


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


@dataclass(frozen=True, kw_only=True)
class Expected:
    """What a reader waits for: records rung with `doorbell` carrying `event_id`.
    stage: the step named in errors ("dispatch", "A2E'", "receive"); call: which call, in words."""

    stage: str
    event_id: int
    doorbell: int
    call: str


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


def missing_peers(mem: DieMemory, records: Sequence[RecordAt], doorbell: int) -> list[int]:
    """Writers of `records` (in our window) whose doorbell does not hold `doorbell` yet."""
    return [r.peer for r in records if not _has_rung(mem, r, doorbell)]


def _has_rung(mem: DieMemory, record: RecordAt, doorbell: int) -> bool:
    return mem.load_word(record.offset + DOORBELL_OFFSET, record.peer) == doorbell


def read(
    mem: DieMemory, records: Sequence[RecordAt], expected: Expected, dtype: np.dtype
) -> np.ndarray:
    """The bodies [W] `dtype` of records whose doorbells rang; EventMismatch on a foreign event."""
    mem.sync()  # the peers' body Puts, flushed before their doorbells, become visible
    if len(records) == 1:
        at = records[0].offset
        bodies = mem.local[at : at + RECORD_BYTES].copy().view(dtype)
    else:
        bodies = np.empty(len(records), dtype)
        raw = bodies.view(np.uint8).reshape(len(records), RECORD_BYTES)
        for record, row in zip(records, raw):
            row[:] = mem.local[record.offset : record.offset + RECORD_BYTES]
    check_events(mem, records, expected, bodies)
    return bodies


def check_events(
    mem: DieMemory, records: Sequence[RecordAt], expected: Expected, bodies: np.ndarray
) -> None:
    """EventMismatch naming the first of `bodies` (read from `records`) with a foreign event."""
    mismatch = bodies["event_id"] != expected.event_id
    if mismatch.any():
        i = int(np.flatnonzero(mismatch)[0])
        got, peer = int(bodies["event_id"][i]), records[i].peer
        raise event_mismatch(mem.rank, expected.stage, expected.event_id, expected.call, peer, got)


def event_mismatch(
    rank: int, stage: str, event_id: int, call: str, peer: int, got: int
) -> EventMismatch:
    """The error for a record from `peer` carrying event `got` where `event_id` was awaited
    (`stage`, `call`: as in Expected)."""
    return EventMismatch(
        f"die rank {rank}: {stage} expected event {event_id}, rank {peer} reported event {got} "
        f"({call})"
    )


def ready(
    mem: DieMemory, records: Sequence[RecordAt], expected: Expected, dtype: np.dtype
) -> np.ndarray | None:
    """read() if every doorbell rang, else None."""
    if missing_peers(mem, records, expected.doorbell):
        return None
    return read(mem, records, expected, dtype)


def no_record(mem: DieMemory, expected: Expected, missing: Sequence[int]) -> str:
    return (
        f"die rank {mem.rank}: {expected.stage} event {expected.event_id} ({expected.call}):"
        f" no record from rank(s) {list(missing)}"
    )


def wait(
    mem: DieMemory,
    records: Sequence[RecordAt],
    expected: Expected,
    dtype: np.dtype,
    *,
    timeout_s: float,
    interrupt: Interrupt | None,
) -> np.ndarray:
    """ready() polled until it holds; XcclTimeout after `timeout_s` naming the missing peers."""
    poll = WordPoll(mem, [r.offset + DOORBELL_OFFSET for r in records], [r.peer for r in records])
    await_doorbells(mem, records, poll, expected, timeout_s=timeout_s, interrupt=interrupt)
    return read(mem, records, expected, dtype)


def await_doorbells(
    mem: DieMemory,
    records: Sequence[RecordAt],
    poll: WordPoll,
    expected: Expected,
    *,
    timeout_s: float,
    interrupt: Interrupt | None,
) -> None:
    """Poll `records`' doorbells (`poll`: over the same records, in order) until every one
    rang; PeerTimeout after `timeout_s` naming die, stage, event and the missing peers."""
    pending = list(range(len(records)))  # indices of the records whose doorbell is missing
    since = time.time()

    def all_rang() -> bool:
        pending[:] = poll.missing(expected.doorbell, pending)
        return not pending

    try:
        poll_until(
            all_rang,
            deadline=time.monotonic() + timeout_s,
            interrupt=interrupt,
            park=mem.wake_words.sleeper(
                (r.peer for r in records), all_rang, lambda: [records[i].peer for i in pending]
            ),
            describe=lambda: (
                f"{no_record(mem, expected, [records[i].peer for i in pending])} after "
                f"{timeout_s:g} s"
            ),
        )
    except XcclTimeout as exc:  # the same message, with die, stage, event and peers as fields
        peers = tuple(records[i].peer for i in pending)
        raise PeerTimeout(
            str(exc),
            die=mem.rank,
            op=expected.stage,
            event_id=expected.event_id,
            peers=peers,
            since=since,
        ) from None
    except RollbackRequested as exc:  # whom this die still waited for, for the vote's blame
        if pending:
            exc.waiting = (mem.rank, min(records[i].peer for i in pending), since)
        raise


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
