"""The reader's end of a record (xccl/records/record.py): waiting for doorbells, reading bodies.

A reader polls the doorbells of the records it expects until every one holds the publication
number, does `Win.Sync` (the writer's body, flushed before its doorbell, becomes visible), reads
the bodies and refuses a stale or misrouted event id. A wait is bounded: its timeout names die,
stage, event, call and the peers whose records are missing; it sleeps instead of spinning when
every awaited writer can wake it (xccl/wake.py).

  WordPoll  many doorbells of this die's window polled together: the words whose writer is
            reached by load/store compared in one numpy operation after one `Win.Sync`; a
            writer polled through MPI (another node, or `poll_idiom: rma`) keeps `load_word`'s
            Fetch_and_op (docs/mpi.md §2), fetched again only while still missing.
  FanIn     one record per member read every call (dispatch/combine), bound once: the doorbells
            in one WordPoll, the bodies one copy when they sit side by side (the EP layout).
  wait      any list of records, settled on every call (a FanIn bound for the one call).
  InRecord  one slot read again and again (p2p's ring records), its doorbell polled with the
            writer's idiom (`DieMemory.word_loader`).
Bound readers are valid until the window is freed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xccl.errors import EventMismatch, PeerTimeout, RollbackRequested, XcclTimeout
from xccl.gmem import WORD, DieMemory
from xccl.layout import RECORD_BYTES
from xccl.records.record import DOORBELL_OFFSET, RecordAt
from xccl.recovery.faults import Interrupt
from xccl.wake import poll_until


@dataclass(frozen=True, kw_only=True)
class Expected:
    """What a reader waits for: records rung with `doorbell` carrying `event_id`.
    stage: the step named in errors ("dispatch", "A2E'", "receive"); call: which call, in words."""

    stage: str
    event_id: int
    doorbell: int
    call: str


class WordPoll:
    """Words at `offsets` of this die's window, `writers[i]` writing word i."""

    def __init__(self, mem: DieMemory, offsets: Sequence[int], writers: Sequence[int]) -> None:
        if len(offsets):  # every word lies between the lowest and the highest
            low, high = min(offsets), max(offsets)
            mem.check(mem.rank, low, high - low + WORD.itemsize, "load_word")
        self.mem, self.writers = mem, list(writers)
        near = [i for i, w in enumerate(self.writers) if not mem.poll_by_rma[w]]
        self._near = np.array(near, np.intp)
        self._near_words = np.array([offsets[i] // WORD.itemsize for i in near], np.intp)
        self._far = [(i, offsets[i], w) for i, w in enumerate(self.writers) if mem.poll_by_rma[w]]

    def missing(self, value: int, pending: Sequence[int] | None = None) -> list[int]:
        """Indices of the words that do not hold `value` yet (near writers first). pending: the
        indices the last call returned, if this wait made one: a rung word stays rung until
        the wait ends, so only those far words are fetched again (one MPI call each)."""
        mem, missing = self.mem, []
        if len(self._near_words):
            mem.sync()
            differs = mem.words[self._near_words] != np.uint64(value)
            if differs.any():
                missing = self._near[differs].tolist()
        still = None if pending is None else set(pending)
        for i, offset, writer in self._far:
            if (still is None or i in still) and mem.load_word(offset, writer) != value:
                missing.append(i)
        return missing


def wait(
    mem: DieMemory,
    records: Sequence[RecordAt],
    expected: Expected,
    dtype: np.dtype,
    *,
    timeout_s: float,
    interrupt: Interrupt | None,
) -> np.ndarray:
    """ready() polled until it holds; PeerTimeout after `timeout_s` naming the missing peers.
    The records bound for this one call (FanIn)."""
    return FanIn(mem, records, dtype).wait(expected, timeout_s=timeout_s, interrupt=interrupt)


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
        """`wait` on the bound records: the bodies [len(sources)] once every doorbell
        rang; PeerTimeout naming the missing peers, EventMismatch on a foreign event."""
        mem = self.mem
        await_doorbells(
            mem, self.sources, self.poll, expected, timeout_s=timeout_s, interrupt=interrupt
        )
        if self._block is None:
            return read(mem, self.sources, expected, self.dtype)
        mem.sync()  # the peers' bodies, written before their doorbells, become visible
        bodies = self._block.copy().view(self.dtype)
        check_events(mem, self.sources, expected, bodies)
        return bodies


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


def missing_peers(mem: DieMemory, records: Sequence[RecordAt], doorbell: int) -> list[int]:
    """Writers of `records` (in our window) whose doorbell does not hold `doorbell` yet."""
    return [r.peer for r in records if not _has_rung(mem, r, doorbell)]


def _has_rung(mem: DieMemory, record: RecordAt, doorbell: int) -> bool:
    return mem.load_word(record.offset + DOORBELL_OFFSET, record.peer) == doorbell


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
        Expected, for the message)."""
        self.mem.sync()  # the writer's body, written before its doorbell, becomes visible
        values = self._record.item(0)
        if values[1] != event_id:
            raise event_mismatch(self.mem.rank, stage, event_id, call, self.at.peer, values[1])
        return values
