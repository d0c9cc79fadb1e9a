"""The metadata record and both its ends (xDeepServe §3): what a record is, the one order every
protocol publishes it in, and the one way every reader waits for it.

A record is RECORD_BYTES in the reader's window, written by one peer: word 0 is the doorbell, the
rest the body, named fields of a numpy structured dtype (the paper's 32-byte field, plus the
doorbell, the writer's virtual time and sizes):
    P2P_RECORD   p2p (xccl/p2p/channel.py): chunk id, tail pointer, message and publication sizes,
    cores
    ROWS_RECORD  dispatch/combine and A2E/E2A (xccl/ep/buffer.py, xccl/afd/buffer.py): rows and
    where they sit
Publishing: Put every body, flush, then ring each doorbell with the publication number and flush,
so a reader that sees the number never acts on a half-written body (docs/mpi.md §2); then
wake the readers asleep in their wait (xccl/wake.py).

Three writers keep that order (docs/mpi.md §2):
  publish   any list of records, settled on every call (path, bounds, offsets);
  OutRecord one slot used again and again (p2p's ring records), settled once: on load/store its
            body is one structured store into the reader's memory, then `Win.Sync`, the doorbell,
            `Win.Sync`; on RMA a staged Put, flush, one Accumulate, flush;
  FanOut    one slot per reader written every call (dispatch/combine, the agreement), bound once:
            per publication a Put, a doorbell store and a barrier per member would be ~200
            window calls per dispatch at 64 dies; bound, the near readers' bodies and doorbells
            are plain stores with one barrier after the bodies and one after the doorbells
            (one strided store for all bodies, one for all doorbells, when the readers'
            windows lie evenly spaced in one mapping, as MPICH's do on one node).
Bound writers are valid until the window is freed.

The reader's end: a reader polls the doorbells of the records it expects until every one holds the
publication number, does `Win.Sync` (the writer's body, flushed before its doorbell, becomes
visible), reads the bodies and refuses a stale or misrouted event id. A wait is bounded: its timeout
names die, stage, event, call and the peers whose records are missing; it sleeps instead of spinning
when every awaited writer can wake it (xccl/wake.py).

  WordPoll  many doorbells of this die's window polled together: the words whose writer is
            reached by load/store compared in one numpy operation after one `Win.Sync`; a
            writer polled through MPI (another node, or `poll_idiom: rma`) keeps `load_word`'s
            Fetch_and_op (docs/mpi.md §2), fetched again only while still missing.
  FanIn     one record per member read every call (dispatch/combine), bound once: the doorbells
            in one WordPoll, the bodies one copy when they sit side by side (the EP layout).
  wait      any list of records, settled on every call (a FanIn bound for the one call).
  InRecord  one slot read again and again (p2p's ring records), its doorbell polled with the
            writer's idiom (`DieMemory.word_loader`).
Bound readers are valid until the window is freed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from xccl.errors import EventMismatch, PeerTimeout, RollbackRequested, XcclTimeout
from xccl.gmem import WORD, DieMemory
from xccl.layout import RECORD_BYTES
from xccl.recovery.faults import Interrupt
from xccl.wake import Meeting, poll_until


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
        wakes: bool = True,
    ) -> None:
        self.mem, self.targets = mem, list(targets)
        # wakes: readers may sleep naming this die (False: they sleep in a meeting, xccl/wake.py)
        self.peers = [at.peer for at in self.targets] if wakes else []
        self._body = slice(body_at, body_at + body_bytes)
        self._bell_at = bell_at
        self._near: list[tuple[int, np.ndarray]] = []  # (i, the body's bytes in reader i)
        self._near_rows: np.ndarray | None = None  # i of every near reader, when not all are
        self._bells: list[np.ndarray] = []  # [1] uint64 doorbells of the near readers
        self._far: list[tuple[int, RecordAt]] = []  # (i, a reader reached by RMA)
        for i, at in enumerate(self.targets):
            region = mem.region(at.peer, at.offset, slot_bytes)
            if region is None:
                self._far.append((i, at))
            else:
                self._near.append((i, region[self._body]))
                self._bells.append(region[bell_at : bell_at + WORD.itemsize].view(WORD))
        self._near_dsts = [dst for _, dst in self._near]
        if len(self._near) < len(self.targets):
            self._near_rows = np.array([i for i, _ in self._near], np.intp)
        # The same bytes of every near reader as rows of one view, when the readers' windows lie
        # evenly spaced in one mapping (MPICH's on one node): a publication's bodies are then
        # one store and its doorbells another, not one numpy call per reader each
        # (publish was 7 % of a die's CPU at 64 dies).
        self._near_block = evenly_spaced(self._near_dsts)
        self._bell_block = evenly_spaced(self._bells)

    @classmethod
    def records(
        cls, mem: DieMemory, targets: Sequence[RecordAt], dtype: np.dtype, *, wakes: bool = True
    ) -> FanOut:
        """A record of `dtype` in each of `targets`: its fields after the doorbell, then it."""
        body_bytes = put_bytes(dtype) - BODY_OFFSET
        return cls(
            mem,
            targets,
            slot_bytes=RECORD_BYTES,
            body_at=BODY_OFFSET,
            body_bytes=body_bytes,
            bell_at=DOORBELL_OFFSET,
            wakes=wakes,
        )

    def publish(self, slots: np.ndarray, doorbell: int) -> None:
        """slots: [len(targets), slot bytes] uint8, target i's slot in row i (only the body
        bytes are sent), or [slot bytes] for every target alike. Every body, a barrier, then
        every doorbell rung with `doorbell`, a barrier; sleeping readers woken."""
        mem, body = self.mem, self._body
        if slots.ndim == 1:
            every = slots[body]
            if self._near_block is not None:
                self._near_block[:] = every
            else:
                for dst in self._near_dsts:
                    dst[:] = every
        elif self._near_dsts:  # the rows' bodies as one view, a row each
            rows = slots[:, body] if self._near_rows is None else slots[self._near_rows, body]
            if self._near_block is not None:
                self._near_block[:] = rows
            else:
                for dst, row in zip(self._near_dsts, rows):
                    dst[:] = row
        for i, at in self._far:  # Puts read `slots` until the flush
            data = slots[body] if slots.ndim == 1 else slots[i, body]
            mem.put(at.peer, at.offset + body.start, data)
        if self._far:
            mem.flush_all()  # Flush_all, then the Win.Sync the near bodies need
        else:
            mem.sync()  # the bodies before the doorbells
        if self._bell_block is not None:
            self._bell_block[:] = doorbell  # an aligned 8-byte store each: atomic
        else:
            for bell in self._bells:
                bell[0] = doorbell  # one aligned 8-byte store: atomic
        for _, at in self._far:
            mem.store_word(at.peer, at.offset + self._bell_at, doorbell)
            mem.flush(at.peer)  # the word buffer is reused by the next store
        if self._bells:
            mem.sync()
        mem.wake_words.wake(self.peers)  # readers asleep in their wait


def evenly_spaced(views: Sequence[np.ndarray]) -> np.ndarray | None:
    """[len(views), *shape] over `views` (alike in shape and dtype, each contiguous) when their
    first bytes lie at one stride from each other in memory: a store into a row is a store
    into that view. None for fewer than two views, or any other placement."""
    if len(views) < 2:
        return None
    first = views[0]
    if not first.flags.c_contiguous or any(
        v.shape != first.shape or v.dtype != first.dtype or not v.flags.c_contiguous for v in views
    ):
        return None
    starts = [v.__array_interface__["data"][0] for v in views]
    stride = starts[1] - starts[0]
    if stride < first.nbytes or any(b - a != stride for a, b in zip(starts, starts[1:])):
        return None  # overlapping, out of order or unevenly spaced
    # Every element of the view is an element of one of `views`: each lies in its reader's
    # window, all of them kept mapped by the window (the bound writer's lifetime).
    return np.lib.stride_tricks.as_strided(
        first, (len(views), *first.shape), (stride, *first.strides), writeable=True
    )


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


@dataclass(frozen=True, kw_only=True)
class Expected:
    """What a reader waits for: records rung with `doorbell` carrying `event_id`.
    stage: the step named in errors ("dispatch", "A2E'", "receive"); call: which call, in words."""

    stage: str
    event_id: int
    doorbell: int
    call: str


# Up to this many words a poll reads them one by one in Python, all of them (at 3 words 1.8
# against 5.1 us a try: numpy's fancy index, compare, count and index again cost a call each) or
# the ones a wait still misses (at 64 dies, most tries look for a few late peers' words).
FEW_WORDS = 32


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
        # Word i's index in the window (near), or -1 (far: polled through MPI).
        self._word_of = [-1 if mem.poll_by_rma[w] else offsets[i] // WORD.itemsize
                         for i, w in enumerate(self.writers)]  # fmt: skip
        self._far_at = {i: (offset, writer) for i, offset, writer in self._far}

    def missing(self, value: int, pending: Sequence[int] | None = None) -> list[int]:
        """Indices of the words that do not hold `value` yet (near writers first). pending: the
        indices the last call returned, if this wait made one: a rung word stays rung until
        the wait ends, so only those words are read again (a far one is one MPI call)."""
        to_read = range(len(self.writers)) if pending is None else pending
        if len(to_read) <= FEW_WORDS:
            return self.missing_among(value, to_read)
        mem, missing = self.mem, []
        if len(self._near_words):
            mem.sync()
            differs = mem.words[self._near_words] != np.uint64(value)
            if np.count_nonzero(differs):  # a C call: `any` wraps a Python method (docs/scale.md)
                missing = self._near[differs].tolist()
        still = None if pending is None else set(pending)
        for i, offset, writer in self._far:
            if (still is None or i in still) and mem.load_word(offset, writer) != value:
                missing.append(i)
        return missing

    def missing_among(self, value: int, pending: Sequence[int]) -> list[int]:
        """`missing` over the few words (at most FEW_WORDS) of `pending` only, one by one (near
        ones first)."""
        mem, word_of, missing, far = self.mem, self._word_of, [], []
        words, synced = mem.words, False
        for i in pending:
            at = word_of[i]
            if at < 0:
                far.append(i)
                continue
            if not synced:
                mem.sync()
                synced = True
            if words.item(at) != value:
                missing.append(i)
        for i in far:
            if mem.load_word(*self._far_at[i]) != value:
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
    meeting: Meeting | None = None,
) -> None:
    """Poll `records`' doorbells (`poll`: over the same records, in order) until every one
    rang; PeerTimeout after `timeout_s` naming die, stage, event and the missing peers.
    meeting: the records are a meeting's (xccl/wake.py), whose sleeps this wait takes part in."""
    pending = list(range(len(records)))  # indices of the records whose doorbell is missing
    since = time.time()

    # A wait on few words reads them one by one from the start (`missing` would pick the same
    # and cost one more frame on every try).
    missing = poll.missing_among if len(records) <= FEW_WORDS else poll.missing

    def all_rang() -> bool:
        pending[:] = missing(expected.doorbell, pending)
        return not pending

    try:
        poll_until(
            all_rang,
            deadline=time.monotonic() + timeout_s,
            interrupt=interrupt,
            serve=mem.far_server,
            park=mem.wake_words.sleeper(
                (r.peer for r in records),
                all_rang,
                lambda: [records[i].peer for i in pending],
                meeting,
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
    if meeting is not None:
        meeting.arrived()


class FanIn:
    """The records `sources` in this die's window, each written by its peer."""

    def __init__(
        self,
        mem: DieMemory,
        sources: Sequence[RecordAt],
        dtype: np.dtype,
        *,
        meeting: Meeting | None = None,
    ) -> None:
        self.mem, self.sources, self.dtype = mem, list(sources), dtype
        self.meeting = meeting  # the sources are a meeting's: its sleeps (xccl/wake.py)
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
            mem,
            self.sources,
            self.poll,
            expected,
            timeout_s=timeout_s,
            interrupt=interrupt,
            meeting=self.meeting,
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
