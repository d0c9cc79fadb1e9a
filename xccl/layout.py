"""Where p2p's records, acks and rings sit in a die's window, computed in one place.

A die's window = [metadata area | p2p rings]. For the ordered pairs a deployment declares
(src -> dst, a die may pair with itself):

    metadata area of die d = RECORD_BYTES x (RECORDS_PER_PAIR x in_d + out_d)
        RECORDS_PER_PAIR records per sender s -> d, used in turn by its publications (written by
        s: doorbell, event id, chunk id, tail, ...), so s can publish while d reads the previous
        one ack word per receiver d -> r, padded to a record (written by r; the words after it
        carry r's landing for a rendezvous, xccl/p2p/lanes.py)
    rings of die d         = in_d x ring_slots x slot_bytes
        one ring of S slots x B bytes per sender s -> d

    window_bytes(d) = RECORD_BYTES x (2 in_d + out_d) + in_d x S x B

in_d / out_d count the pairs into / out of d. Declaring all N x N pairs costs every die
2N records + N rings (at 768 dies, S=8, B=64 KiB: 384 MiB of rings per die), so a deployment
declares only the pairs that talk (e.g. prefill -> decode dies for KV transfer).
Every rank computes the same layout from the same inputs, so a sender knows the offsets of its
record and ring in the receiver's window without asking. The dispatch/combine and A2E/E2A areas
follow the p2p part of the window (xccl/moe_layout.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from xccl.errors import OutOfWindow, UnknownPeer

# One metadata record (its fields: xccl/records/record.py): 8 words, the doorbell first.
RECORD_BYTES = 64
RECORDS_PER_PAIR = 2


@dataclass(frozen=True)
class P2PLayout:
    """Offsets of p2p records, acks and rings in every rank's window."""

    num_ranks: int
    ring_slots: int
    slot_bytes: int
    pairs: frozenset[tuple[int, int]]
    _records: dict = field(init=False, repr=False, compare=False)
    _acks: dict = field(init=False, repr=False, compare=False)
    _rings: dict = field(init=False, repr=False, compare=False)
    _sizes: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.ring_slots <= 0 or self.slot_bytes <= 0 or self.slot_bytes % 8:
            raise ValueError(
                f"ring_slots({self.ring_slots}) must be > 0 and slot_bytes"
                f"({self.slot_bytes}) a positive multiple of 8"
            )
        for src, dst in self.pairs:
            if not (0 <= src < self.num_ranks and 0 <= dst < self.num_ranks):
                raise UnknownPeer(f"pair {src} -> {dst} outside ranks 0..{self.num_ranks - 1}")
        records, acks, rings, sizes = {}, {}, {}, []
        ring_bytes = self.ring_slots * self.slot_bytes
        senders_of = [[] for _ in range(self.num_ranks)]
        receivers_of = [[] for _ in range(self.num_ranks)]
        for src, dst in sorted(self.pairs):
            senders_of[dst].append(src)
            receivers_of[src].append(dst)
        for d in range(self.num_ranks):
            senders, receivers = senders_of[d], receivers_of[d]
            offset = 0
            for s in senders:
                records[(s, d)] = offset
                offset += RECORDS_PER_PAIR * RECORD_BYTES
            for r in receivers:
                acks[(d, r)] = offset
                offset += RECORD_BYTES
            for s in senders:
                rings[(s, d)] = offset
                offset += ring_bytes
            sizes.append(offset)
        object.__setattr__(self, "_records", records)
        object.__setattr__(self, "_acks", acks)
        object.__setattr__(self, "_rings", rings)
        object.__setattr__(self, "_sizes", tuple(sizes))

    @classmethod
    def build(
        cls, num_ranks: int, ring_slots: int, slot_bytes: int, pairs: Iterable[tuple[int, int]]
    ) -> P2PLayout:
        return cls(num_ranks, ring_slots, slot_bytes, frozenset(pairs))

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.slot_bytes

    def window_bytes(self, rank: int) -> int:
        """Size hint: bytes rank's window needs for p2p (callable before allocation)."""
        return self._sizes[rank]

    def max_window_bytes(self) -> int:
        return max(self._sizes, default=0)

    def check_cap(self, cap_bytes: int) -> None:
        """Refuse a layout that some die cannot hold, with the numbers."""
        for rank, size in enumerate(self._sizes):
            if size > cap_bytes:
                ins = sum(1 for s, t in self._rings if t == rank)
                outs = sum(1 for s, t in self._acks if s == rank)
                raise OutOfWindow(
                    f"rank {rank}'s window needs {size} B = {RECORD_BYTES} x ({RECORDS_PER_PAIR} x "
                    f"{ins} in + {outs} out) records + {ins} rings x {self.ring_slots} slots x "
                    f"{self.slot_bytes} B"
                    f", over the per-die cap xccl.max_window_bytes({cap_bytes})"
                )

    def _lookup(self, table: dict, src: int, dst: int, what: str) -> int:
        try:
            return table[(src, dst)]
        except KeyError:
            raise UnknownPeer(
                f"no p2p {what} for rank {src} -> rank {dst}: the pair is not "
                f"declared (declared pairs: {len(self.pairs)})"
            ) from None

    def record_offset(self, src: int, dst: int, seq: int = 0) -> int:
        """Offset in dst's window of the record src writes for its publication number `seq`."""
        base = self._lookup(self._records, src, dst, "record")
        return base + (seq % RECORDS_PER_PAIR) * RECORD_BYTES

    def ack_offset(self, src: int, dst: int) -> int:
        """Offset in src's window of the ack word dst writes."""
        return self._lookup(self._acks, src, dst, "ack")

    def ring_offset(self, src: int, dst: int) -> int:
        """Offset in dst's window of the ring src writes into."""
        return self._lookup(self._rings, src, dst, "ring")

    def slot_runs(self, first_slot: int, nbytes: int) -> list[tuple[int, int, int]]:
        """Split `nbytes` starting at ring slot `first_slot` (mod S) into contiguous runs.

        Returns [(ring byte offset, message byte offset, length)], at most two (wrap-around).
        """
        start = (first_slot % self.ring_slots) * self.slot_bytes
        first = min(nbytes, self.ring_bytes - start)
        runs = [(start, 0, first)] if first else []
        if nbytes > first:
            runs.append((0, first, nbytes - first))
        return runs


def all_pairs(ranks: Iterable[int]) -> frozenset[tuple[int, int]]:
    ranks = list(ranks)
    return frozenset((s, d) for s in ranks for d in ranks)
