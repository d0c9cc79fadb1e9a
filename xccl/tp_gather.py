"""All-gather and all-to-all within a tensor-parallel group by one-sided writes (a prefill DP
group of several dies, xDeepServe §5.1's prefill TEs with TP=4; CloudMatrix-Infer §4.3.1's
hybrid parallelism).

Every member holds one piece of an array (its share of the rows); after `all_gather` every member
holds every piece, in member order. `exchange` is the all-to-all: member i sends piece j to
member j (its heads' outputs of member j's rows). The writer's end is the record pattern of
xccl/records/record.py: each member

    1. Puts its piece for each other member into its slot of that member's window,
    2. Puts a ROWS_RECORD body (event id, bytes, its virtual time) into its record there,
       flushes, then rings each record's doorbell with the call's publication number (`publish`),
    3. waits for every other member's doorbell in its own window (a bounded FanIn wait: its
       timeout names die, stage, event and the missing peers), then reads their pieces.

No acks: the records and slots alternate between two parities by publication number. A member
can only start call k + 2 (parity k % 2 again) after every peer published call k + 1, and a
peer publishes k + 1 only after it read everything of call k, so a slot is never overwritten
while its reader still needs it (the EP buffer's argument, one call deeper).

The layout (`TpLayout`) sits in every member's window from `base[rank]` on:
    records   2 parities x num_members x RECORD_BYTES   (member i writes record [parity, i])
    slots     2 parities x num_members x slot_bytes     (member i's piece)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xccl.gmem import DieMemory
from xccl.layout import RECORD_BYTES
from xccl.records import ROWS_RECORD, Expected, FanIn, RecordAt, publish

NUM_PARITIES = 2


@dataclass(frozen=True, kw_only=True)
class TpLayout:
    """The TP gather area of one TP group: members (ranks, in order), base (per rank of the
    communicator: where the area starts; members only), slot_bytes (the largest piece)."""

    members: tuple[int, ...]
    base: tuple[int, ...]
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.slot_bytes % 8:
            raise ValueError(
                f"TpLayout.slot_bytes must be a positive multiple of 8, got {self.slot_bytes}"
            )

    @property
    def num_members(self) -> int:
        return len(self.members)

    def area_bytes(self) -> int:
        """Bytes of the area in each member's window."""
        return NUM_PARITIES * self.num_members * (RECORD_BYTES + self.slot_bytes)

    def record_offset(self, rank: int, parity: int, writer_idx: int) -> int:
        """Where member `writer_idx`'s record of `parity` sits in `rank`'s window."""
        return self.base[rank] + (parity * self.num_members + writer_idx) * RECORD_BYTES

    def slot_offset(self, rank: int, parity: int, writer_idx: int) -> int:
        """Where member `writer_idx`'s piece of `parity` sits in `rank`'s window."""
        records = NUM_PARITIES * self.num_members * RECORD_BYTES
        return (
            self.base[rank] + records + (parity * self.num_members + writer_idx) * (self.slot_bytes)
        )


@dataclass(frozen=True, kw_only=True)
class Gathered:
    """One all-gather's result: pieces (every member's, in member order) and sent_ns (the
    latest virtual time a peer stamped when it published: the gather cannot end earlier)."""

    pieces: list[np.ndarray]
    sent_ns: float


class TpGather:
    """One member's end of its TP group's all-gather (one object per window: it claims it)."""

    def __init__(self, mem: DieMemory, layout: TpLayout, *, clock, timeout_s: float) -> None:
        """clock: this die's virtual clock (stamped into the records); timeout_s: how long a
        wait for the peers' records may take."""
        mem.claim("tp gather")
        self.mem, self.layout, self.clock, self.timeout_s = mem, layout, clock, timeout_s
        self.me = mem.rank
        self.me_idx = layout.members.index(self.me)
        self.peers = [(i, r) for i, r in enumerate(layout.members) if r != self.me]
        self.seq = 0
        self._out = [
            [RecordAt(r, layout.record_offset(r, p, self.me_idx)) for _, r in self.peers]
            for p in range(NUM_PARITIES)
        ]
        self._in = [
            FanIn(
                mem,
                [RecordAt(r, layout.record_offset(self.me, p, i)) for i, r in self.peers],
                ROWS_RECORD,
            )
            for p in range(NUM_PARITIES)
        ]

    def all_gather(
        self, piece: np.ndarray, shapes: list[tuple[int, ...]], event_id: int, what: str
    ) -> Gathered:
        """piece: this member's array (shape shapes[me]); shapes: every member's piece shape
        (the same dtype); what: the call in errors ("attention layer 3"). Every member gets
        every piece."""
        return self.exchange([piece] * len(self.layout.members), shapes, event_id, what)

    def exchange(
        self, outgoing: list[np.ndarray], shapes: list[tuple[int, ...]], event_id: int, what: str
    ) -> Gathered:
        """The all-to-all: outgoing[i] goes to member i (ours stays here); shapes[i]: the
        shape of the piece member i sends us (the dtype of ours). Returns the pieces for us,
        in member order."""
        layout, mem = self.layout, self.mem
        outgoing = [np.ascontiguousarray(p) for p in outgoing]
        for i, piece in enumerate(outgoing):
            if piece.nbytes > layout.slot_bytes or (
                i == self.me_idx and piece.shape != tuple(shapes[i])
            ):
                raise ValueError(
                    f"die rank {self.me}: tp gather {what}: piece {piece.shape} of {piece.nbytes}"
                    f" B for member {i}, expected {tuple(shapes[i])} within slot_bytes"
                    f"({layout.slot_bytes})"
                )
        self.seq += 1
        parity = self.seq % NUM_PARITIES
        # Step 1: each peer's piece into our slot of its window.
        for i, peer in self.peers:
            raw = outgoing[i].reshape(-1).view(np.uint8)
            mem.put(peer, layout.slot_offset(peer, parity, self.me_idx), raw)
        # Step 2: the records' bodies, a flush (pieces and bodies complete), the doorbells.
        bodies = np.zeros(len(self.peers), ROWS_RECORD)
        bodies["event_id"] = event_id
        bodies["count"] = [outgoing[i].nbytes for i, _ in self.peers]
        bodies["vtime_ns"] = self.clock.now_ns
        if self.peers:
            publish(mem, self._out[parity], bodies, self.seq)
        # Step 3: every peer's record in our window, then its piece.
        expected = Expected(
            stage="tp gather", event_id=event_id, doorbell=self.seq, call=f"{what}, call {self.seq}"
        )
        got = self._in[parity].wait(expected, timeout_s=self.timeout_s, interrupt=None)
        dtype = outgoing[self.me_idx].dtype
        pieces = [
            outgoing[i] if rank == self.me
            else self._read(got[self._index(i)], i, rank, parity, dtype, shapes[i], what)
            for i, rank in enumerate(layout.members)
        ]  # fmt: skip
        sent = float(got["vtime_ns"].max(initial=0.0)) if len(got) else 0.0
        return Gathered(pieces=pieces, sent_ns=sent)

    def _index(self, member_idx: int) -> int:
        """The position of member `member_idx` among the peers (the FanIn's order)."""
        return member_idx if member_idx < self.me_idx else member_idx - 1

    def _read(self, record, i: int, rank: int, parity: int, dtype, shape, what: str) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if int(record["count"]) != nbytes:
            raise ValueError(
                f"die rank {self.me}: tp gather {what}: rank {rank} wrote {int(record['count'])} B,"
                f" expected {nbytes} B for a piece {tuple(shape)}"
            )
        at = self.layout.slot_offset(self.me, parity, i)
        return self.mem.local[at : at + nbytes].copy().view(dtype).reshape(shape)
