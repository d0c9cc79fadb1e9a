"""Where everything sits in a die's window, computed in one place.

A die's window = [metadata area | p2p rings]. For the ordered pairs a deployment declares
(src -> dst, a die may pair with itself):

    metadata area of die d = RECORD_BYTES x (RECORDS_PER_PAIR x in_d + out_d)
        RECORDS_PER_PAIR records per sender s -> d, used in turn by its publications (written by
        s: doorbell, event id, chunk id, tail, ...), so s can publish while d reads the previous
        one ack word per receiver d -> r, padded to a record (written by r)
    rings of die d         = in_d x ring_slots x slot_bytes
        one ring of S slots x B bytes per sender s -> d

    window_bytes(d) = RECORD_BYTES x (2 in_d + out_d) + in_d x S x B

in_d / out_d count the pairs into / out of d. Declaring all N x N pairs costs every die
2N records + N rings (at 768 dies, S=8, B=64 KiB: 384 MiB of rings per die), so a deployment
declares only the pairs that talk (e.g. prefill -> decode dies for KV transfer).
Every rank computes the same layout from the same inputs, so a sender knows the offsets of its
record and ring in the receiver's window without asking.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

from xccl.errors import OutOfWindow, UnknownPeer

# One metadata record: 8 words of 64 bits (the paper's field is 32 bytes; the emulator adds the
# doorbell, the sender's virtual time and the message size).
RECORD_WORDS = 8
RECORD_BYTES = RECORD_WORDS * 8
# Word indices inside a record (the last word: AIV cores used | is_dma << 32).
DOORBELL, EVENT_ID, CHUNK_ID, TAIL, VTIME_NS, MSG_BYTES, PUB_BYTES, CORES = range(RECORD_WORDS)
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
            raise ValueError(f"ring_slots({self.ring_slots}) must be > 0 and slot_bytes"
                             f"({self.slot_bytes}) a positive multiple of 8")
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
    def build(cls, num_ranks: int, ring_slots: int, slot_bytes: int,
              pairs: Iterable[tuple[int, int]]) -> "P2PLayout":
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
                    f"{ins} in + {outs} out) records + {ins} rings x {self.ring_slots} slots x {self.slot_bytes} B"
                    f", over the per-die cap xccl.max_window_bytes({cap_bytes})")

    def _lookup(self, table: dict, src: int, dst: int, what: str) -> int:
        try:
            return table[(src, dst)]
        except KeyError:
            raise UnknownPeer(f"no p2p {what} for rank {src} -> rank {dst}: the pair is not "
                              f"declared (declared pairs: {len(self.pairs)})") from None

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



def send_row_bytes(hidden: int, itemsize: int, use_int8: bool) -> int:
    """A staged token row: hidden x itemsize, or INT8 values + a float32 scale; 8-byte aligned."""
    raw = hidden + 4 if use_int8 else hidden * itemsize
    return (raw + 7) // 8 * 8


# Dispatch/combine record words (one record per peer and direction; written by the peer).
EP_DOORBELL, EP_EVENT_ID, EP_COUNT, EP_OFFSET, EP_VTIME_NS = range(5)
INDEX_BYTES = 16   # per staged row: int32 token index, int32 top-k column, int64 physical slot


@dataclass(frozen=True, kw_only=True)
class EpLayout:
    """The dispatch/combine area of every EP member's window (xDeepServe §3.2, Figure 7).

    Per member die, from `base[rank]` on (the same size on every member; 0 bytes elsewhere):
        dispatch records   num_members x RECORD_BYTES   (peer p writes: count, offset, event id)
        combine records    num_members x RECORD_BYTES
        dispatch staging   max_send_rows x send_row_bytes   (own rows, partitioned by dest die)
        dispatch index     max_send_rows x INDEX_BYTES      (token, column, slot of each row)
        combine staging    max_recv_rows x out_row_bytes    (expert outputs, by source die)
    max_send_rows = max_tokens x num_columns (top-k, + 1 with dedicated shared experts);
    max_recv_rows = num_members x max_send_rows (every row of every die may go to one die);
    send_row_bytes = hidden x itemsize, or hidden + 4 (INT8 + float32 scale) rounded up to 8;
    out_row_bytes = hidden x itemsize. Combine has its own records and staging so a fast die's
    combine never overwrites what a slow die still pulls from dispatch.
    """

    members: tuple[int, ...]           # ranks taking part in dispatch/combine, in order
    base: tuple[int, ...]              # per rank of the communicator: where the EP area starts
    hidden: int
    max_tokens: int
    num_columns: int
    itemsize: int
    use_int8: bool

    def __post_init__(self) -> None:
        for name in ("hidden", "max_tokens", "num_columns", "itemsize"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EpLayout.{name} must be > 0, got {getattr(self, name)}")

    @property
    def num_members(self) -> int:
        return len(self.members)

    @property
    def send_row_bytes(self) -> int:
        return send_row_bytes(self.hidden, self.itemsize, self.use_int8)

    @property
    def out_row_bytes(self) -> int:
        return self.hidden * self.itemsize

    @property
    def max_send_rows(self) -> int:
        return self.max_tokens * self.num_columns

    @property
    def max_recv_rows(self) -> int:
        return self.num_members * self.max_send_rows

    @cached_property
    def _area(self) -> dict[str, int]:
        sizes = {"dispatch_records": self.num_members * RECORD_BYTES,
                 "combine_records": self.num_members * RECORD_BYTES,
                 "dispatch_rows": self.max_send_rows * self.send_row_bytes,
                 "dispatch_index": self.max_send_rows * INDEX_BYTES,
                 "combine_rows": self.max_recv_rows * self.out_row_bytes}
        offsets, at = {}, 0
        for name, size in sizes.items():
            offsets[name] = at
            at += (size + 63) // 64 * 64
        offsets["end"] = at
        return offsets

    def area_bytes(self) -> int:
        """Size hint: bytes of the EP area on each member die."""
        return self._area["end"]

    def offset(self, rank: int, region: str) -> int:
        """Byte offset of `region` in `rank`'s window."""
        return self.base[rank] + self._area[region]

    def record_offset(self, rank: int, kind: str, peer_idx: int) -> int:
        """The record member `peer_idx` writes into `rank`'s window for `kind` (dispatch/combine)."""
        return self.offset(rank, f"{kind}_records") + peer_idx * RECORD_BYTES


# A2E/E2A record words beyond the dispatch ones: where a sender's shared-expert rows sit.
AFD_SHARED_COUNT, AFD_SHARED_OFFSET = 5, 6
AFD_ROLES = ("attention", "expert")


@dataclass(frozen=True, kw_only=True)
class AfdLayout:
    """The A2E/E2A area of attention and expert dies (xDeepServe §3.3 Figure 8, §5.2).

    Every region exists once per lane; a lane is one (DP domain, microbatch) pair, so a domain's
    next layer reuses its lane only after that lane's E2A completed (the reuse argument in
    xccl/afd.py). "scatter" regions hold rows a die sends to expert dies, staged dest-major in its
    own window (trampolines for A2E', attention dies in the direct variant); routed rows may be
    INT8, shared-expert rows are always full precision (the reference quantizes routed rows only).

    attention die, per lane:
        back_records  E x RECORD_BYTES                  (written by expert dies: E2A / E2A')
        tok_rows      max_tokens x out_row_bytes        (A2E stage 1: each token once)
        tok_route     max_tokens x num_columns x 8      (its physical slots, -1 = none)
        scatter_rows  max_rows x send_row_bytes         (direct variant)
        scatter_shared max_tokens x out_row_bytes
        scatter_index (max_rows + max_tokens) x INDEX_BYTES
    expert die, per lane:
        a2e_records   A x RECORD_BYTES                  (from attention dies: stage 1 or direct)
        fwd_records   G x RECORD_BYTES                  (from trampolines: A2E')
        back_records  E x RECORD_BYTES                  (trampolines: E2A' from expert dies)
        scatter_*     as above                          (trampolines: A2E' forwarding)
        out_rows      max_recv_rows x out_row_bytes     (expert outputs, by source)
        ret_rows      (max_rows + max_tokens) x out_row_bytes   (trampolines: E2A to attention)
    max_rows = max_tokens x top_k; max_recv_rows = max(G, ...) senders x (max_rows + max_tokens),
    senders = G trampolines (or the G attention dies of a domain in the direct variant).
    """

    attention: tuple[int, ...]         # attention ranks, domain-major: domain d = [d*G, (d+1)*G)
    experts: tuple[int, ...]           # expert ranks; experts[g] is the trampoline of group g
    group_size: int                    # G attention dies per DP domain
    base: tuple[int, ...]              # per rank of the communicator: where the area starts
    num_lanes: int                     # DP domains x microbatches
    hidden: int
    max_tokens: int
    top_k: int
    has_shared: bool                   # a shared-expert column (weight 1) after the top-k
    itemsize: int
    use_int8: bool

    def __post_init__(self) -> None:
        for name in ("group_size", "num_lanes", "hidden", "max_tokens", "top_k", "itemsize"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AfdLayout.{name} must be > 0, got {getattr(self, name)}")
        if len(self.attention) % self.group_size:
            raise ValueError(f"{len(self.attention)} attention dies are not whole DP domains of "
                             f"group_size({self.group_size})")
        if len(self.experts) < self.group_size:
            raise ValueError(f"{len(self.experts)} expert dies < group_size({self.group_size}): "
                             "every attention die of a domain needs its own trampoline")

    @property
    def num_columns(self) -> int:
        return self.top_k + (1 if self.has_shared else 0)

    @property
    def send_row_bytes(self) -> int:
        return send_row_bytes(self.hidden, self.itemsize, self.use_int8)

    @property
    def out_row_bytes(self) -> int:
        return self.hidden * self.itemsize

    @property
    def max_rows(self) -> int:
        return self.max_tokens * self.top_k

    @property
    def max_sent_rows(self) -> int:
        """Rows one sender scatters: routed + shared."""
        return self.max_rows + (self.max_tokens if self.has_shared else 0)

    @property
    def max_recv_rows(self) -> int:
        return self.group_size * self.max_sent_rows

    def role_of(self, rank: int) -> str:
        if rank in self.attention:
            return "attention"
        if rank in self.experts:
            return "expert"
        raise ValueError(f"rank {rank} is neither an attention nor an expert die of the layout")

    @cached_property
    def _areas(self) -> dict[str, dict[str, int]]:
        num_attention, num_experts = len(self.attention), len(self.experts)
        scatter = {"scatter_rows": self.max_rows * self.send_row_bytes,
                   "scatter_shared": self.max_tokens * self.out_row_bytes,
                   "scatter_index": self.max_sent_rows * INDEX_BYTES}
        per_lane = {
            "attention": {"back_records": num_experts * RECORD_BYTES,
                          "tok_rows": self.max_tokens * self.out_row_bytes,
                          "tok_route": self.max_tokens * self.num_columns * 8, **scatter},
            "expert": {"a2e_records": num_attention * RECORD_BYTES,
                       "fwd_records": self.group_size * RECORD_BYTES,
                       "back_records": num_experts * RECORD_BYTES, **scatter,
                       "out_rows": self.max_recv_rows * self.out_row_bytes,
                       "ret_rows": self.max_sent_rows * self.out_row_bytes}}
        areas = {}
        for role, sizes in per_lane.items():
            offsets, at = {}, 0
            for name, size in sizes.items():
                offsets[name] = at
                at += (size + 63) // 64 * 64
            offsets["lane"] = at                     # bytes of one lane
            offsets["end"] = at * self.num_lanes
            areas[role] = offsets
        return areas

    def area_bytes(self, role: str) -> int:
        """Size hint: bytes of the A2E/E2A area on an attention or expert die."""
        return self._areas[role]["end"]

    def offset(self, rank: int, region: str, lane: int = 0) -> int:
        """Byte offset of `region` of `lane` in `rank`'s window."""
        area = self._areas[self.role_of(rank)]
        if not 0 <= lane < self.num_lanes:
            raise ValueError(f"lane {lane} outside 0..{self.num_lanes - 1}")
        return self.base[rank] + lane * area["lane"] + area[region]

    def record_offset(self, rank: int, region: str, lane: int, writer_idx: int) -> int:
        """The record writer number `writer_idx` (its index among attention dies, trampolines or
        expert dies, by region) writes into `rank`'s `region` of `lane`."""
        return self.offset(rank, region, lane) + writer_idx * RECORD_BYTES
