"""Pull-based MoE dispatch / combine over die memory (xDeepServe §3.2, Figure 7).

dispatch: every die stages the rows it sends in its OWN window, partitioned by destination die,
tells each destination (zero rows included) how many rows sit where, waits until every die told
it the same, and pulls its rows with Get. combine mirrors it with separate records and staging:
each die stages its experts' outputs by source die, and every source pulls its rows back and sums
each token's columns, weighted, in column order (deterministic whatever the arrival order).

Why no acks: a die restages dispatch rows only after its combine completed, which needs every die
it sent rows to to have pulled them (they computed and staged outputs); a die restages combine
outputs only after the next dispatch, which needs every die's next dispatch record, written after
that die's combine pulled everything. So the two phases must alternate, every die taking part.

Recovery (xccl/faults.py): the doorbells are the buffer's publication numbers, one per kind. After
an abandoned attempt the dies' numbers differ (some published, some did not); resync moves every
die to the max over all dies, so the next publication, max + 1, matches no doorbell left behind.
Fault hooks fire after staging, before the records: "dispatch" between steps 3 and 4 of dispatch,
"combine" between steps 3 and 4 of combine, so every peer is left waiting in its step 5.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from xccl.errors import BufferTooSmall, EventMismatch, XcclError
from xccl.faults import FaultHook, Interrupt, RecoveryHooks
from xccl.gmem import DieMemory, poll_until
from xccl.layout import (EP_COUNT, EP_DOORBELL, EP_EVENT_ID, EP_OFFSET, EP_VTIME_NS, INDEX_BYTES,
                         EpLayout)
from xccl.quant import decode_rows, encode_rows
from xccl.vclock import LinkModel, VirtualClock

INDEX_DTYPE = np.dtype([("token", "<i4"), ("column", "<i4"), ("slot", "<i8")])
assert INDEX_DTYPE.itemsize == INDEX_BYTES


@dataclass(frozen=True, kw_only=True)
class DispatchInfo:
    """The rows that arrived, contiguous per local expert slot.

    local_slots: [L] physical slots this die hosts, ascending; recv_x holds their rows in order.
    num_rows_per_slot: [L] int64 rows for each local slot.
    src_rank: [R] int64 rank each row came from; src_token: [R] its token index there;
    src_column: [R] its top-k column there (column num_topk = the dedicated shared expert).
    """

    local_slots: tuple[int, ...]
    num_rows_per_slot: np.ndarray
    src_rank: np.ndarray
    src_token: np.ndarray
    src_column: np.ndarray


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """What combine needs to send results home. Valid for one combine after its own dispatch.

    event_id: the dispatch's event id. seq: which dispatch of the buffer `buffer_id` made it.
    weights: [num_tokens, num_columns] float64 combine weights (0 where topk_idx is -1).
    send_counts: [num_members] rows sent to each member; send_token / send_column: [rows sent]
    token and column of each staged row (destination-major, the order peers pull them in).
    recv_counts: [num_members] rows pulled from each member.
    recv_perm: [R] for each row of recv_x, its index among the rows as pulled (source-major).
    """

    event_id: int
    seq: int
    buffer_id: int
    weights: np.ndarray
    send_counts: np.ndarray
    send_token: np.ndarray
    send_column: np.ndarray
    recv_counts: np.ndarray
    recv_perm: np.ndarray


def select_slots(topk_idx: np.ndarray, log2phy: Sequence[Sequence[int]],
                 shared_slots: Sequence[int], src_rank: int) -> np.ndarray:
    """[T, K] logical experts (-1 = none) -> [T, C] physical slots (-1 = none).

    A token whose expert has several replicas takes replica (token index mod replicas): spread by
    position, no communication (§4.5 step 4). With dedicated shared-expert slots, column K is
    slot shared_slots[(src_rank + token) mod len(shared_slots)].
    """
    num_tokens, top_k = topk_idx.shape
    num_replicas = np.array([len(r) for r in log2phy], np.int64)      # [E]
    table = np.full((len(log2phy), max(num_replicas, default=1)), -1, np.int64)
    for expert, replicas in enumerate(log2phy):
        table[expert, :len(replicas)] = replicas
    token = np.arange(num_tokens)[:, None]                            # [T, 1]
    expert = np.where(topk_idx >= 0, topk_idx, 0)
    phy = table[expert, token % np.maximum(num_replicas[expert], 1)]  # [T, K]
    phy = np.where(topk_idx >= 0, phy, -1)
    if shared_slots:
        shared = np.asarray(shared_slots)[(src_rank + token[:, 0]) % len(shared_slots)]
        phy = np.concatenate([phy, shared[:, None]], axis=1)
    return phy


class EpBuffer:
    """Dispatch/combine for one EP group on this die's window (one per window)."""

    def __init__(self, mem: DieMemory, layout: EpLayout, slot_owner: Sequence[int], *,
                 dtype=np.float64, clock: VirtualClock | None = None,
                 link: LinkModel | None = None, num_cores: int = 2, timeout_s: float = 60.0) -> None:
        mem.claim("ep")
        if np.dtype(dtype).itemsize != layout.itemsize:
            raise ValueError(f"rank {mem.rank}: row dtype {np.dtype(dtype)} ({np.dtype(dtype).itemsize}"
                             f" B) != the EP layout's itemsize {layout.itemsize} B")
        if mem.nbytes < layout.offset(mem.rank, "end"):
            raise BufferTooSmall(f"rank {mem.rank}: window of {mem.nbytes} B < the "
                                 f"{layout.offset(mem.rank, 'end')} B the EP layout needs")
        self.mem, self.layout, self.me = mem, layout, mem.rank
        self.members = layout.members
        self.me_idx = self.members.index(mem.rank)
        self.member_of_rank = np.full(max(self.members) + 1, -1, np.int64)
        self.member_of_rank[list(self.members)] = np.arange(len(self.members))
        self.slot_owner = np.asarray(slot_owner, np.int64)               # [num slots] -> rank
        self.local_slots = tuple(int(s) for s in np.flatnonzero(self.slot_owner == mem.rank))
        self.dtype = np.dtype(dtype)
        self.clock, self.link = clock or VirtualClock(), link
        self.num_cores, self.timeout_s = num_cores, timeout_s
        self._seq = {"dispatch": 0, "combine": 0}
        self.fault_hook: FaultHook | None = None      # (op, event_id), may raise InjectedFault
        self.interrupt: Interrupt | None = None       # every wait turn; may raise RollbackRequested

    def set_recovery(self, hooks: RecoveryHooks) -> None:
        """Install the recovery hooks (once, by the die's recomputer; xccl/faults.py)."""
        self.interrupt, self.fault_hook = hooks.interrupt, hooks.fault_hook

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch(self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                 event_id: int, *, log2phy: Sequence[Sequence[int]],
                 shared_slots: Sequence[int] = ()) -> tuple[np.ndarray, DispatchInfo,
                                                            DispatchHandle]:
        """Send each token's row to the slots of its experts; receive this die's rows.

        x: [T, hidden] float rows. topk_idx: [T, K] int logical experts, -1 = no expert.
        topk_weights: [T, K] float. event_id: this layer/iteration (peers must use the same).
        log2phy: [E] tuple of physical slots per logical expert (replicas allowed).
        shared_slots: physical slots of dedicated shared experts (adds column K, weight 1).
        Returns recv_x [R, hidden] (self.dtype, dequantized), DispatchInfo, DispatchHandle.
        Every member must call it, with zero tokens if it has none.
        """
        phy, weights = self._check_batch(x, topk_idx, topk_weights, event_id, log2phy,
                                         shared_slots)
        # Step 1-3 (Fig. 7): copy the rows (INT8 + per-token scale if enabled) into our own
        # managed area, partitioned by destination die.
        token, column = np.nonzero(phy >= 0)                          # [S] each
        slot = phy[token, column]
        dest = self.member_of_rank[self.slot_owner[slot]]
        order = np.lexsort((column, token, slot, dest))
        token, column, slot, dest = token[order], column[order], slot[order], dest[order]
        self._stage_rows(x, token, column, slot)
        send_counts = np.bincount(dest, minlength=len(self.members))
        if self.fault_hook is not None:     # staged, not yet published: every peer waits for us
            self.fault_hook("dispatch", event_id)
        # Step 4: write count + offset + event id + virtual time into every destination's record.
        seq = self._publish("dispatch", event_id, send_counts)
        # Step 5: poll our metadata until every die has reported (zero rows included).
        recv_counts, recv_offsets, stamps = self._wait_records("dispatch", event_id, seq)
        # Step 6-7: pull our rows from each die with Get.
        rows, index = self._pull_dispatch(recv_counts, recv_offsets)
        self._arrive(stamps, rows.nbytes + index.nbytes)
        decoded = decode_rows(rows, hidden=self.layout.hidden, use_int8=self.layout.use_int8,
                              dtype=self.dtype)
        perm = np.lexsort((index["column"], index["token"], np.repeat(
            np.arange(len(self.members)), recv_counts), index["slot"]))
        if len(index) and not np.isin(index["slot"], self.local_slots).all():
            raise XcclError(f"die rank {self.me}: dispatch event {event_id} delivered rows for "
                            f"slots {sorted(set(index['slot']) - set(self.local_slots))} this "
                            "die does not host")
        src_rank = np.asarray(self.members, np.int64)[np.repeat(
            np.arange(len(self.members)), recv_counts)]
        info = DispatchInfo(
            local_slots=self.local_slots,
            num_rows_per_slot=np.array([(index["slot"] == s).sum() for s in self.local_slots],
                                       np.int64),
            src_rank=src_rank[perm], src_token=index["token"][perm].astype(np.int64),
            src_column=index["column"][perm].astype(np.int64))
        handle = DispatchHandle(event_id=event_id, seq=seq, buffer_id=id(self), weights=weights,
                                send_counts=send_counts, send_token=token, send_column=column,
                                recv_counts=recv_counts, recv_perm=perm)
        return decoded[perm], info, handle

    # -- combine --------------------------------------------------------------------------------
    def combine(self, expert_out: np.ndarray, handle: DispatchHandle) -> np.ndarray:
        """Send expert outputs home and sum each token's columns, weighted, in column order.

        expert_out: [R, hidden] aligned with the recv_x of `handle`'s dispatch.
        Returns y: [T, hidden] float64 for this die's T dispatched tokens (rows cross in
        self.dtype; the sum is always float64, as the model's reference makes it).
        """
        if handle.buffer_id != id(self):
            raise XcclError(f"die rank {self.me}: combine with a handle of another buffer "
                            f"(event {handle.event_id})")
        if handle.seq != self._seq["dispatch"] or self._seq["combine"] >= handle.seq:
            raise XcclError(f"die rank {self.me}: combine with the handle of dispatch "
                            f"{handle.seq} (event {handle.event_id}); the last dispatch was "
                            f"{self._seq['dispatch']} and combines done {self._seq['combine']}")
        if expert_out.shape != (len(handle.recv_perm), self.layout.hidden):
            raise ValueError(f"die rank {self.me}: expert_out {expert_out.shape} != "
                             f"({len(handle.recv_perm)}, {self.layout.hidden}) rows received")
        # Step 1-3 (mirror): stage outputs in our combine area, by source die, in the order
        # each source staged them.
        start, num_rows = self.layout.offset(self.me, "combine_rows"), len(expert_out)
        staged = self.mem.local[start:start + num_rows * self.layout.out_row_bytes]
        staged.view(self.dtype).reshape(num_rows, self.layout.hidden)[handle.recv_perm] = expert_out
        self.mem.sync()
        if self.fault_hook is not None:
            self.fault_hook("combine", handle.event_id)
        # Step 4: tell each source where its outputs sit.
        seq = self._publish("combine", handle.event_id, handle.recv_counts)
        # Step 5: wait for every die's record; step 6-7: pull our rows' outputs back.
        counts, offsets, stamps = self._wait_records("combine", handle.event_id, seq)
        if not np.array_equal(counts, handle.send_counts):
            raise XcclError(f"die rank {self.me}: combine event {handle.event_id} returns "
                            f"{counts.tolist()} rows per die, dispatch sent "
                            f"{handle.send_counts.tolist()}")
        outs = np.empty((int(counts.sum()), self.layout.hidden), self.dtype)
        self._pull(outs.view(np.uint8).reshape(len(outs), self.layout.out_row_bytes),
                   "combine_rows", counts, offsets, self.layout.out_row_bytes)
        self._arrive(stamps, outs.nbytes)
        num_tokens, num_columns = handle.weights.shape
        y = np.zeros((num_tokens, self.layout.hidden), np.float64)
        for c in range(num_columns):  # fixed order: the same sum on every run
            rows = np.flatnonzero(handle.send_column == c)
            token = handle.send_token[rows]                  # each token once per column
            y[token] += handle.weights[token, c, None] * outs[rows]
        return y

    # -- recovery -------------------------------------------------------------------------------
    def publication_state(self) -> tuple[int, int]:
        """(dispatches, combines) published: the last doorbell of each kind."""
        return self._seq["dispatch"], self._seq["combine"]

    def abandon(self) -> None:
        """Complete outstanding RMA. Handles of the abandoned attempt are refused by combine."""
        self.mem.flush_all()

    def resync(self, state) -> None:
        """Abandon, then continue from `state` = (dispatches, combines), the max over all dies."""
        self.abandon()
        dispatches, combines = (int(v) for v in state)
        if dispatches < self._seq["dispatch"] or combines < self._seq["combine"]:
            raise ValueError(f"die rank {self.me}: resync to {dispatches} dispatches, {combines} "
                             f"combines would go back from {self.publication_state()}")
        self._seq = {"dispatch": dispatches, "combine": combines}

    # -- steps ----------------------------------------------------------------------------------
    def _check_batch(self, x, topk_idx, topk_weights, event_id, log2phy, shared_slots):
        layout, (num_tokens, top_k) = self.layout, topk_idx.shape
        if num_tokens > layout.max_tokens:
            raise BufferTooSmall(f"die rank {self.me}: dispatch of {num_tokens} tokens > "
                                 f"max_tokens_per_die({layout.max_tokens}) (event {event_id});"
                                 " nothing was sent")
        num_columns = top_k + (1 if shared_slots else 0)
        if x.shape != (num_tokens, layout.hidden) or topk_weights.shape != topk_idx.shape or \
                num_columns != layout.num_columns:
            raise ValueError(f"die rank {self.me}: x {x.shape}, topk_idx {topk_idx.shape}, "
                             f"topk_weights {topk_weights.shape}, {len(shared_slots)} shared "
                             f"slots do not fit hidden {layout.hidden} and "
                             f"{layout.num_columns} columns")
        if topk_idx.size and (topk_idx.max() >= len(log2phy) or topk_idx.min() < -1):
            raise ValueError(f"die rank {self.me}: topk_idx outside -1..{len(log2phy) - 1}")
        phy = select_slots(topk_idx, log2phy, shared_slots, self.me)
        weights = np.zeros((num_tokens, num_columns))
        weights[:, :top_k] = np.where(topk_idx >= 0, topk_weights, 0.0)
        weights[:, top_k:] = 1.0
        return phy, weights

    def _stage_rows(self, x: np.ndarray, token, column, slot) -> None:
        layout, local, num_rows = self.layout, self.mem.local, len(token)
        start = layout.offset(self.me, "dispatch_rows")
        staged = local[start:start + num_rows * layout.send_row_bytes].reshape(
            num_rows, layout.send_row_bytes)                            # [S, row bytes] in window
        encode_rows(staged, x, token, hidden=layout.hidden, use_int8=layout.use_int8,
                    dtype=self.dtype)
        index = np.zeros(num_rows, INDEX_DTYPE)
        index["token"], index["column"], index["slot"] = token, column, slot
        start = layout.offset(self.me, "dispatch_index")
        local[start:start + index.nbytes] = index.view(np.uint8)
        self.mem.sync()  # our stores land before any peer is told to pull them

    def _publish(self, kind: str, event_id: int, counts: np.ndarray) -> int:
        """Write (event, count, offset, time) into each member's record, flush, then doorbells."""
        mem, seq = self.mem, self._seq[kind] + 1
        self._seq[kind] = seq
        bodies = np.zeros((len(self.members), 4), np.uint64)   # one per member: Puts in flight
        bodies[:, 0], bodies[:, 1], bodies[:, 2] = event_id, counts, np.cumsum(counts) - counts
        bodies.view(np.float64)[:, 3] = self.clock.now_ns
        for i, rank in enumerate(self.members):
            mem.put(rank, self.layout.record_offset(rank, kind, self.me_idx) + 8, bodies[i])
        mem.flush_all()
        for rank in self.members:
            mem.store_word(rank, self.layout.record_offset(rank, kind, self.me_idx) +
                           8 * EP_DOORBELL, seq)
            mem.flush(rank)  # the word buffer is reused by the next store
        return seq

    def _wait_records(self, kind: str, event_id: int, seq: int):
        mem, members = self.mem, self.members
        records = [self.layout.record_offset(self.me, kind, i) for i in range(len(members))]
        pending = set(range(len(members)))

        def all_reported() -> bool:
            for i in list(pending):
                if mem.load_word(records[i] + 8 * EP_DOORBELL, members[i]) == seq:
                    pending.discard(i)
            return not pending
        poll_until(all_reported, deadline=time.monotonic() + self.timeout_s,
                   interrupt=self.interrupt,
                   describe=lambda: f"die rank {self.me}: {kind} event {event_id} (call {seq}): "
                   f"no record from rank(s) {[members[i] for i in sorted(pending)]} after "
                   f"{self.timeout_s:g} s")
        mem.sync()
        words = np.stack([mem.words[r // 8:r // 8 + 5] for r in records])   # [N, 5]
        bad = np.flatnonzero(words[:, EP_EVENT_ID] != event_id)
        if len(bad):
            i = int(bad[0])
            raise EventMismatch(f"die rank {self.me}: {kind} expected event {event_id}, rank "
                                f"{members[i]} reported event {int(words[i, EP_EVENT_ID])} "
                                f"({int(words[i, EP_COUNT])} rows)")
        stamps = words[:, EP_VTIME_NS].copy().view(np.float64)
        return words[:, EP_COUNT].astype(np.int64), words[:, EP_OFFSET].astype(np.int64), stamps

    def _pull(self, out: np.ndarray, region: str, counts, offsets, row_bytes: int) -> None:
        """Get counts[i] rows of `row_bytes` from member i's `region` at row offsets[i]."""
        at = 0
        for i, rank in enumerate(self.members):
            if counts[i]:
                self.mem.get(rank, self.layout.offset(rank, region) + int(offsets[i]) * row_bytes,
                             out[at:at + counts[i]].reshape(-1))
                at += counts[i]
        self.mem.flush_all()

    def _pull_dispatch(self, counts, offsets) -> tuple[np.ndarray, np.ndarray]:
        total, layout = int(counts.sum()), self.layout
        rows = np.empty((total, layout.send_row_bytes), np.uint8)
        index = np.empty(total, INDEX_DTYPE)
        self._pull(rows, "dispatch_rows", counts, offsets, layout.send_row_bytes)
        self._pull(index.view(np.uint8).reshape(total, INDEX_BYTES), "dispatch_index", counts,
                   offsets, INDEX_BYTES)
        return rows, index

    def _arrive(self, stamps: np.ndarray, nbytes: int) -> None:
        """Virtual time: wait for the last peer's record; with a link model, add its latency and
        the time our link takes to pull the bytes (without one, the caller prices the transfer)."""
        if self.link is None:
            self.clock.arrive(float(stamps.max(initial=0.0)))
            return
        self.clock.arrive(float(stamps.max(initial=0.0)) + self.link.latency_ns())
        self.clock.advance(self.link.serialization_ns(nbytes, num_cores=self.num_cores))
