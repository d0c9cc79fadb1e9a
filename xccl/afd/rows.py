"""Where A2E/E2A rows are staged in this die's window and pulled from a peer's (xccl/afd/buffer.py).

Staging writes the lane's regions of our own window (xccl/moe_layout.py AfdLayout) and ends with
a Win.Sync so the stores land before a record tells a peer to pull them. Pulls are Gets through
the records object, which counts the bytes, flushed before the rows are read; each pull advances
the virtual clock by the bytes it moved. What staging and pulling hand back: ScatterPlan,
A2EHandle, Received.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xccl.afd.records import AfdCall, AfdRecords
from xccl.errors import XcclError
from xccl.gmem import DieMemory
from xccl.moe_layout import INDEX_BYTES, INDEX_DTYPE, AfdLayout
from xccl.quant import decode_rows, encode_rows


@dataclass(frozen=True, kw_only=True)
class ScatterPlan:
    """Rows a die staged for the expert dies. order: [R] for each staged row (dest-major) its
    index in the sender's row list; counts: [E] routed rows per expert die; shared_counts: [E]
    full-precision shared-expert rows per expert die (staged after the routed ones)."""

    order: np.ndarray
    counts: np.ndarray
    shared_counts: np.ndarray


@dataclass(frozen=True, kw_only=True)
class A2EHandle:
    """What e2a needs. weights: [T, C] float64 (0 where topk_idx is -1, 1 for the shared column).
    row_token / row_column: [R] the token and column of every row, in the order outputs return."""

    call: AfdCall
    weights: np.ndarray
    row_token: np.ndarray
    row_column: np.ndarray
    scatter: ScatterPlan | None  # direct variant: what was scattered to the expert dies


@dataclass(frozen=True, kw_only=True)
class Received:
    """Rows an expert die pulled for one call: x [R, hidden], slot / token / column [R] int64,
    sender_counts [S] rows from each sender (trampoline, or attention die when direct)."""

    call: AfdCall
    x: np.ndarray
    slot: np.ndarray
    token: np.ndarray
    column: np.ndarray
    sender_counts: np.ndarray


class AfdRows:
    def __init__(self, mem: DieMemory, layout: AfdLayout, records: AfdRecords, dtype) -> None:
        self.mem, self.layout, self.records, self.me = mem, layout, records, mem.rank
        self.dtype = np.dtype(dtype)

    def _stage(self, region: str, lane: int, data: np.ndarray) -> None:
        at = self.layout.offset(self.me, region, lane)
        self.mem.local[at : at + data.nbytes] = (
            np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        )

    def stage_tokens(self, lane: int, x: np.ndarray, phy: np.ndarray) -> None:
        """Each token once, full precision [T, hidden], and its physical slots [T, C]."""
        self._stage("tok_rows", lane, np.asarray(x, self.dtype))
        self._stage("tok_route", lane, phy.astype(np.int64))
        self.mem.sync()

    def pull_tokens(self, src: int, lane: int, bodies: np.ndarray):
        """An attention die's tokens x [T, hidden] and slots route [T, C] (T from its record)."""
        layout, num_tokens = self.layout, int(bodies["count"][0])
        x = np.empty((num_tokens, layout.hidden), self.dtype)
        route = np.empty((num_tokens, layout.num_columns), np.int64)  # [T, C] slots
        self.records.get(src, layout.offset(src, "tok_rows", lane), x)
        self.records.get(src, layout.offset(src, "tok_route", lane), route)
        self.mem.flush(src)
        self.records.arrive(bodies, x.nbytes + route.nbytes)
        return x, route

    def stage_scatter(self, lane: int, x, token, column, slot, dest, is_shared) -> ScatterPlan:
        """Stage rows [R] (x[token]) by destination expert die `dest`, routed rows (INT8 if
        enabled) then shared rows, with their index rows."""
        layout = self.layout
        order = np.lexsort((column, token, is_shared, dest))  # [R] dest-major
        token, slot, dest, is_shared = token[order], slot[order], dest[order], is_shared[order]
        routed, shared = ~is_shared, is_shared
        num_routed = int(routed.sum())
        at = layout.offset(self.me, "scatter_rows", lane)
        rows = self.mem.local[at : at + num_routed * layout.send_row_bytes].reshape(
            num_routed, layout.send_row_bytes
        )
        encode_rows(
            rows, x, token[routed], hidden=layout.hidden, use_int8=layout.use_int8, dtype=self.dtype
        )
        self._stage("scatter_shared", lane, x[token[shared]].astype(self.dtype))
        index = np.zeros(len(order), INDEX_DTYPE)
        index["token"], index["column"], index["slot"] = token, column[order], slot
        self._stage("scatter_index", lane, index)
        self.mem.sync()
        num_experts = len(layout.experts)
        return ScatterPlan(
            order=order,
            counts=np.bincount(dest[routed], minlength=num_experts),
            shared_counts=np.bincount(dest[shared], minlength=num_experts),
        )

    def pull_scattered(self, senders: Sequence[int], lane: int, bodies: np.ndarray):
        """Every sender's rows for us: x [R, hidden] (routed rows decoded) and index [R]."""
        layout = self.layout
        counts, shared = bodies["count"].astype(np.int64), bodies["shared_count"].astype(np.int64)
        raw = np.empty((int(counts.sum()), layout.send_row_bytes), np.uint8)
        x = np.empty((int(counts.sum() + shared.sum()), layout.hidden), self.dtype)
        index = np.empty(len(x), INDEX_DTYPE)
        is_routed = np.zeros(len(x), bool)
        at = routed_at = 0
        for rank, c, s, o, so in zip(
            senders,
            counts,
            shared,
            bodies["offset"].astype(np.int64),
            bodies["shared_offset"].astype(np.int64),
        ):
            self._get_sender_rows(
                rank,
                lane,
                (o, so),
                raw[routed_at : routed_at + c],
                x[at + c : at + c + s],
                index[at : at + c + s],
            )
            is_routed[at : at + c] = True
            at, routed_at = at + c + s, routed_at + c
        self.mem.flush_all()
        x[is_routed] = decode_rows(
            raw, hidden=layout.hidden, use_int8=layout.use_int8, dtype=self.dtype
        )
        self.records.arrive(bodies, raw.nbytes + x[~is_routed].nbytes + index.nbytes)
        return x, index

    def _get_sender_rows(
        self,
        rank: int,
        lane: int,
        offsets: tuple[int, int],
        raw: np.ndarray,
        shared_x: np.ndarray,
        index: np.ndarray,
    ) -> None:
        """Get one sender's rows for us: routed rows raw [c, send_row_bytes] (encoded), shared
        rows shared_x [s, hidden], their index rows index [c + s]; offsets = (routed row, shared
        row) where they start in the sender's regions. Nothing is fetched for an empty part."""
        layout, (routed_offset, shared_offset) = self.layout, offsets
        if len(raw):
            self.records.get(
                rank,
                layout.offset(rank, "scatter_rows", lane) + routed_offset * layout.send_row_bytes,
                raw,
            )
        if len(shared_x):
            self.records.get(
                rank,
                layout.offset(rank, "scatter_shared", lane) + shared_offset * layout.out_row_bytes,
                shared_x,
            )
        if len(index):
            self.records.get(
                rank,
                layout.offset(rank, "scatter_index", lane)
                + (routed_offset + shared_offset) * INDEX_BYTES,
                index.view(np.uint8),
            )

    def stage_outputs(self, region: str, lane: int, out: np.ndarray) -> None:
        """Expert outputs (out_rows) or a trampoline's restaged returns (ret_rows) [R, hidden]."""
        self._stage(region, lane, np.asarray(out, self.dtype))
        self.mem.sync()

    def pull_outputs(
        self, region: str, lane: int, ranks: Sequence[int], bodies: np.ndarray
    ) -> np.ndarray:
        """The rows ranks[i] staged for us in `region`: bodies[i] says how many, from which row;
        returns [R, hidden] in rank order."""
        layout, counts = self.layout, bodies["count"].astype(np.int64)
        staged = np.empty((int(counts.sum()), layout.hidden), self.dtype)
        at = 0
        for rank, count, offset in zip(ranks, counts, bodies["offset"].astype(np.int64)):
            if count:
                self.records.get(
                    rank,
                    layout.offset(rank, region, lane) + offset * layout.out_row_bytes,
                    staged[at : at + count],
                )
                at += count
        if len(ranks) == 1:
            self.mem.flush(ranks[0])
        else:
            self.mem.flush_all()
        self.records.arrive(bodies, staged.nbytes)
        return staged

    def gather_back(self, call: AfdCall, plan: ScatterPlan, stage: str, *, blocking: bool):
        """Outputs of the rows we scattered, in staged (dest-major) order, or None if not all
        expert dies answered yet (non-blocking)."""
        experts = self.layout.experts
        writers = list(zip(experts, range(len(experts))))
        bodies = (
            self.records.wait(call, "back_records", writers, stage)
            if blocking
            else self.records.ready(call, "back_records", writers, stage)
        )
        if bodies is None:
            return None
        counts, sent = bodies["count"].astype(np.int64), plan.counts + plan.shared_counts
        if not np.array_equal(counts, sent):
            raise XcclError(
                f"die rank {self.me}: {stage} event {call.event_id} returns "
                f"{counts.tolist()} rows per expert die, A2E sent {sent.tolist()}"
            )
        return self.pull_outputs("out_rows", call.lane, experts, bodies)
