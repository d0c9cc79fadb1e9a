"""Where the MoE areas sit in a die's window: dispatch/combine (EpLayout) and A2E/E2A (AfdLayout).

Every rank computes the same layout from the same inputs, so a die knows where a peer staged the
rows it pulls and where its own record sits in the peer's window without asking. Records are
xccl/records/record.py's ROWS_RECORD; wire rows are xccl/quant.py's (send_row_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from xccl.layout import RECORD_BYTES
from xccl.quant import send_row_bytes

# Per staged row, next to the rows: its token index, top-k column and physical slot.
INDEX_DTYPE = np.dtype([("token", "<i4"), ("column", "<i4"), ("slot", "<i8")])
INDEX_BYTES = INDEX_DTYPE.itemsize
# Payload words of one member's slot in the between-iterations agreement (xccl/agreement.py):
# a colocated die's work, running flag, EPLB's two boundary words, and with run.clock virtual
# its clock and horizon (ranks/colocated/virtual_time.py).
AGREE_WORDS = 6


@dataclass(frozen=True, kw_only=True)
class EpLayout:
    """The dispatch/combine area of every EP member's window (xDeepServe §3.2, Figure 7).

    Per member die, from `base[rank]` on (the same size on every member; 0 bytes elsewhere):
        dispatch records   num_members x RECORD_BYTES   (peer p writes: count, offset, event id)
        combine records    num_members x RECORD_BYTES
        dispatch staging   max_send_rows x send_row_bytes   (own rows, partitioned by dest die)
        dispatch index     max_send_rows x INDEX_BYTES      (token, column, slot of each row)
        combine staging    max_recv_rows x out_row_bytes    (expert outputs, by source die)
        agreement          2 x num_members x (AGREE_WORDS + 1) x 8   (xccl/agreement.py)
    max_send_rows = max_tokens x num_columns (top-k, + 1 with dedicated shared experts);
    max_recv_rows = num_members x max_tokens x min(num_columns, max_slots_per_die): a token's
        columns name distinct experts, so a die receives at most one row per token for each
        slot it hosts (every token of every die may still come to one die);
    send_row_bytes = hidden x itemsize, or hidden + 4 (INT8 + float32 scale) rounded up to 8;
    out_row_bytes = hidden x itemsize. Combine has its own records and staging so a fast die's
    combine never overwrites what a slow die still pulls from dispatch.

    num_lanes > 1 (colocated two-stream decode, CloudMatrix-Infer §4.2.3): the area above once
    per microbatch, one after the other, so two microbatches in flight never share a slot or a
    record; `lane(i)` is the layout of lane i alone (what one EpBuffer runs on).
    """

    members: tuple[int, ...]  # ranks taking part in dispatch/combine, in order
    base: tuple[int, ...]  # per rank of the communicator: where the EP area starts
    hidden: int
    max_tokens: int
    num_columns: int
    itemsize: int
    use_int8: bool
    max_slots_per_die: int = 0  # expert slots on the die with the most; 0: as many as columns
    num_lanes: int = 1  # microbatches with an area each (a lane's own layout: 1)
    lane_index: int = 0  # which lane of its deployment this layout is

    def __post_init__(self) -> None:
        for name in ("hidden", "max_tokens", "num_columns", "itemsize", "num_lanes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EpLayout.{name} must be > 0, got {getattr(self, name)}")

    def lane(self, index: int) -> EpLayout:
        """Lane `index`'s area alone: this layout moved up by `index` lanes."""
        if not 0 <= index < self.num_lanes:
            raise ValueError(f"EpLayout: lane {index} outside 0..{self.num_lanes - 1}")
        shift = index * self._area["end"]
        return replace(
            self, base=tuple(b + shift for b in self.base), num_lanes=1, lane_index=index
        )

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
        per_token = min(self.num_columns, self.max_slots_per_die or self.num_columns)
        return self.num_members * self.max_tokens * per_token

    @cached_property
    def _area(self) -> dict[str, int]:
        sizes = {
            "dispatch_records": self.num_members * RECORD_BYTES,
            "combine_records": self.num_members * RECORD_BYTES,
            "dispatch_rows": self.max_send_rows * self.send_row_bytes,
            "dispatch_index": self.max_send_rows * INDEX_BYTES,
            "combine_rows": self.max_recv_rows * self.out_row_bytes,
            "agreement": 2 * self.num_members * (AGREE_WORDS + 1) * 8,
        }
        offsets, at = {}, 0
        for name, size in sizes.items():
            offsets[name], offsets[name + "_end"] = at, at + size
            at += (size + 63) // 64 * 64
        offsets["end"] = at
        return offsets

    def area_bytes(self) -> int:
        """Size hint: bytes of the EP area on each member die (every lane)."""
        return self._area["end"] * self.num_lanes

    def offset(self, rank: int, region: str) -> int:
        """Byte offset of `region` in `rank`'s window."""
        return self.base[rank] + self._area[region]

    def row_regions(self, rank: int) -> list[tuple[int, int]]:
        """(offset, nbytes) of `rank`'s row staging (dispatch rows and index, combine rows):
        written before they are read, so they need no zeroing (DieMemory's `unzeroed`)."""
        names = ("dispatch_rows", "dispatch_index", "combine_rows")
        return [
            (self.offset(rank, n) + i * self._area["end"], self._area[n + "_end"] - self._area[n])
            for i in range(self.num_lanes)
            for n in names
        ]

    def record_offset(self, rank: int, kind: str, peer_idx: int) -> int:
        """The record member `peer_idx` writes into `rank`'s window for `kind` (dispatch or
        combine)."""
        return self.offset(rank, f"{kind}_records") + peer_idx * RECORD_BYTES


@dataclass(frozen=True, kw_only=True)
class AfdLayout:
    """The A2E/E2A area of attention and expert dies (xDeepServe §3.3 Figure 8, §5.2).

    Every region exists once per lane; a lane is one (DP domain, microbatch) pair, so a domain's
    next layer reuses its lane only after that lane's E2A completed (the reuse argument in
    xccl/afd/buffer.py). "scatter" regions hold rows a die sends to expert dies, staged dest-major
    in its own window (trampolines for A2E', attention dies in the direct variant); routed rows may
    be INT8, shared-expert rows are always full precision (the reference quantizes routed rows
    only).

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
    every die, once after its lanes:
        agreement     2 x num_members x (AGREE_WORDS + 1) x 8   (xccl/agreement.py)
    max_rows = max_tokens x top_k; max_recv_rows = max(G, ...) senders x (max_rows + max_tokens),
    senders = G trampolines (or the G attention dies of a domain in the direct variant).
    """

    attention: tuple[int, ...]  # attention ranks, domain-major: domain d = [d*G, (d+1)*G)
    experts: tuple[int, ...]  # expert ranks; experts[g] is the trampoline of group g
    group_size: int  # G attention dies per DP domain
    base: tuple[int, ...]  # per rank of the communicator: where the area starts
    num_lanes: int  # DP domains x microbatches
    hidden: int
    max_tokens: int
    top_k: int
    has_shared: bool  # a shared-expert column (weight 1) after the top-k
    itemsize: int
    use_int8: bool

    def __post_init__(self) -> None:
        for name in ("group_size", "num_lanes", "hidden", "max_tokens", "top_k", "itemsize"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AfdLayout.{name} must be > 0, got {getattr(self, name)}")
        if len(self.attention) % self.group_size:
            raise ValueError(
                f"{len(self.attention)} attention dies are not whole DP domains of "
                f"group_size({self.group_size})"
            )
        if len(self.experts) < self.group_size:
            raise ValueError(
                f"{len(self.experts)} expert dies < group_size({self.group_size}): "
                "every attention die of a domain needs its own trampoline"
            )

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

    @property
    def members(self) -> tuple[int, ...]:
        """The dies that agree between iterations (xccl/agreement.py): the attention dies, then
        the expert dies; a lost attention die (-1, ranks/recovery/scale_down.py) is none of
        them."""
        return tuple(r for r in (*self.attention, *self.experts) if r >= 0)

    @cached_property
    def member_domains(self) -> tuple[int, ...]:
        """Per member (`members`, in order): its DP domain, -1 for an expert die."""
        group = self.group_size
        domains = [i // group for i, rank in enumerate(self.attention) if rank >= 0]
        return (*domains, *(-1 for rank in self.experts if rank >= 0))

    def role_of(self, rank: int) -> str:
        if rank in self.attention:
            return "attention"
        if rank in self.experts:
            return "expert"
        raise ValueError(f"rank {rank} is neither an attention nor an expert die of the layout")

    @cached_property
    def _areas(self) -> dict[str, dict[str, int]]:
        num_attention, num_experts = len(self.attention), len(self.experts)
        scatter = {
            "scatter_rows": self.max_rows * self.send_row_bytes,
            "scatter_shared": self.max_tokens * self.out_row_bytes,
            "scatter_index": self.max_sent_rows * INDEX_BYTES,
        }
        per_lane = {
            "attention": {
                "back_records": num_experts * RECORD_BYTES,
                "tok_rows": self.max_tokens * self.out_row_bytes,
                "tok_route": self.max_tokens * self.num_columns * 8,
                **scatter,
            },
            "expert": {
                "a2e_records": num_attention * RECORD_BYTES,
                "fwd_records": self.group_size * RECORD_BYTES,
                "back_records": num_experts * RECORD_BYTES,
                **scatter,
                "out_rows": self.max_recv_rows * self.out_row_bytes,
                "ret_rows": self.max_sent_rows * self.out_row_bytes,
            },
        }
        areas = {}
        for role, sizes in per_lane.items():
            offsets, at = {}, 0
            for name, size in sizes.items():
                offsets[name] = at
                at += (size + 63) // 64 * 64
            offsets["lane"] = at  # bytes of one lane
            offsets["agreement"] = at * self.num_lanes  # offset() with lane 0: after the lanes
            agreement = 2 * len(self.members) * (AGREE_WORDS + 1) * 8
            offsets["end"] = offsets["agreement"] + (agreement + 63) // 64 * 64
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
