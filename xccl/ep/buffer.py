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

Staging and pulling rows live in xccl/ep/rows.py.

Recovery (xccl/recovery/faults.py): the doorbells are the buffer's publication numbers, one per
kind. After
an abandoned attempt the dies' numbers differ (some published, some did not); resync moves every
die to the max over all dies, so the next publication, max + 1, matches no doorbell left behind.
Fault hooks fire after staging, before the records: "dispatch" between steps 3 and 4 of dispatch,
"combine" between steps 3 and 4 of combine, so every peer is left waiting in its step 5.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from mpi4py import MPI

from xccl.agreement import WindowAgreement
from xccl.ep.handles import DispatchHandle, DispatchInfo
from xccl.ep.rows import EpRows
from xccl.errors import BufferTooSmall, XcclError
from xccl.gmem import DieMemory
from xccl.moe_layout import EpLayout
from xccl.quant import decode_rows
from xccl.records import ROWS_RECORD, Expected, FanIn, FanOut, RecordAt
from xccl.recovery.faults import FaultHook, Interrupt, RecoveryHooks
from xccl.routing import combine_weights, select_slots, weighted_column_sum
from xccl.vclock import LinkModel, VirtualClock
from xccl.wait_log import WaitLog


@dataclass(frozen=True, kw_only=True)
class SentDispatch:
    """A dispatch issued (staged and published) and not yet waited for: what its wait needs."""

    event_id: int
    seq: int
    weights: np.ndarray
    send_counts: np.ndarray
    send_token: np.ndarray
    send_column: np.ndarray


@dataclass(frozen=True, kw_only=True)
class SentCombine:
    """A combine issued and not yet waited for."""

    handle: DispatchHandle
    seq: int


@dataclass(frozen=True, kw_only=True)
class EpOptions:
    """What an EpBuffer is built with besides its window, layout and slots: dtype, the rows'
    wire dtype; clock, the die's virtual clock; link, the cost model's link (None: the clock's
    default); num_cores, AIV cores per transfer; timeout_s, every wait's deadline; wait_log,
    where each wait for peers' records is logged for the trace (None: tracing off)."""

    dtype: np.dtype
    clock: VirtualClock
    link: LinkModel | None
    num_cores: int
    timeout_s: float
    wait_log: WaitLog | None


class EpBuffer:
    """Dispatch/combine for one EP group on this die's window (one per window)."""

    def __init__(
        self,
        mem: DieMemory,
        layout: EpLayout,
        slot_owner: Sequence[int],
        *,
        dtype=np.float64,
        clock: VirtualClock | None = None,
        link: LinkModel | None = None,
        num_cores: int = 2,
        timeout_s: float = 60.0,
        wait_log: WaitLog | None = None,
    ) -> None:
        if np.dtype(dtype).itemsize != layout.itemsize:
            raise ValueError(
                f"rank {mem.rank}: dtype {np.dtype(dtype)} of itemsize "
                f"{np.dtype(dtype).itemsize} != the EP layout's itemsize "
                f"{layout.itemsize}"
            )
        mem.claim("ep" if layout.lane_index == 0 else f"ep lane {layout.lane_index}")
        if mem.nbytes < layout.offset(mem.rank, "end"):
            raise BufferTooSmall(
                f"rank {mem.rank}: window of {mem.nbytes} B < the "
                f"{layout.offset(mem.rank, 'end')} B the EP layout needs"
            )
        self.mem, self.layout, self.me = mem, layout, mem.rank
        self.members = layout.members
        self.me_idx = self.members.index(mem.rank)
        self.member_of_rank = np.full(max(self.members) + 1, -1, np.int64)
        self.member_of_rank[list(self.members)] = np.arange(len(self.members))
        self.slot_owner = np.asarray(slot_owner, np.int64)  # [num slots] -> rank
        is_local = self.slot_owner == mem.rank
        self.local_slots = tuple(int(s) for s in np.flatnonzero(is_local))
        # slot -> position in local_slots, -1 if not ours; the appended -1 answers any other slot
        self.local_index = np.append(np.where(is_local, np.cumsum(is_local) - 1, -1), -1)
        self.dtype = np.dtype(dtype)
        self.rows = EpRows(mem, layout, dtype, self.slot_owner, self.member_of_rank)
        self.clock, self.link = clock or VirtualClock(), link
        # wait_log: each wait for peers' records, for the trace (xccl/wait_log.py); None: off
        self.num_cores, self.timeout_s, self.wait_log = num_cores, timeout_s, wait_log
        self.options = EpOptions(
            dtype=self.dtype,
            clock=self.clock,
            link=link,
            num_cores=num_cores,
            timeout_s=timeout_s,
            wait_log=wait_log,
        )
        self._seq = {"dispatch": 0, "combine": 0}
        # xccl/records/record.py
        self._fans = {kind: self._bind_records(kind) for kind in self._seq}
        self.agreement = WindowAgreement(mem, layout, timeout_s=timeout_s)  # between iterations
        self.fault_hook: FaultHook | None = None  # (op, event_id), may raise InjectedFault
        self.interrupt: Interrupt | None = None  # every wait turn; may raise RollbackRequested

    def set_recovery(self, hooks: RecoveryHooks) -> None:
        """Install the recovery hooks (once, by the die's recomputer; xccl/recovery/faults.py)."""
        self.interrupt, self.fault_hook = hooks.interrupt, hooks.fault_hook

    def rebuilt(self, comm: MPI.Comm) -> EpBuffer:
        """This buffer over `comm` (the survivors: a sub-communicator of the one this window
        spans) on a window of its own, with the same options and recovery hooks; slots of the
        dies left out are owned by nobody (-1: the routing never picks them). Collective over
        `comm`. This buffer is never used again (nor freed: its window spans the lost dies)."""
        layout = replace(self.layout, members=tuple(range(comm.size)), base=(0,) * comm.size)
        nbytes = -(-layout.offset(comm.rank, "end") // 8) * 8
        before = self.mem.comm  # the communicator slot_owner numbers ranks in
        in_before = MPI.Group.Translate_ranks(comm.group, list(range(comm.size)), before.group)
        to_new = {old: new for new, old in enumerate(in_before)}
        owners = [to_new.get(int(owner), -1) for owner in self.slot_owner]
        mem = DieMemory(comm, nbytes, unzeroed=layout.row_regions(comm.rank))
        ep = EpBuffer(mem, layout, owners, **vars(self.options))
        ep.set_recovery(RecoveryHooks(interrupt=self.interrupt, fault_hook=self.fault_hook))
        return ep

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch(
        self,
        x: np.ndarray,
        topk_idx: np.ndarray,
        topk_weights: np.ndarray,
        event_id: int,
        *,
        log2phy: Sequence[Sequence[int]],
        shared_slots: Sequence[int] = (),
    ) -> tuple[np.ndarray, DispatchInfo, DispatchHandle]:
        """Send each token's row to the slots of its experts; receive this die's rows.

        x: [T, hidden] float rows. topk_idx: [T, K] int logical experts, -1 = no expert.
        topk_weights: [T, K] float. event_id: this layer/iteration (peers must use the same).
        log2phy: [E] tuple of physical slots per logical expert (replicas allowed).
        shared_slots: physical slots of dedicated shared experts (adds column K, weight 1).
        Returns recv_x [R, hidden] (self.dtype, dequantized), DispatchInfo, DispatchHandle.
        Every member must call it, with zero tokens if it has none.
        """
        sent = self.issue_dispatch(
            x, topk_idx, topk_weights, event_id, log2phy=log2phy, shared_slots=shared_slots
        )
        return self.wait_dispatch(sent)

    def issue_dispatch(
        self,
        x: np.ndarray,
        topk_idx: np.ndarray,
        topk_weights: np.ndarray,
        event_id: int,
        *,
        log2phy: Sequence[Sequence[int]],
        shared_slots: Sequence[int] = (),
    ) -> SentDispatch:
        """Steps 1-4 of `dispatch` (same arguments): stage and publish, no wait. The die may
        compute something else (the other microbatch's attention, CloudMatrix-Infer §4.2.3)
        before `wait_dispatch`; it must not stage through this buffer again until then."""
        phy, weights = self._check_batch(x, topk_idx, topk_weights, event_id, log2phy, shared_slots)
        # Step 1-3 (Fig. 7): copy the rows (INT8 + per-token scale if enabled) into our own
        # managed area, partitioned by destination die.
        token, column, send_counts = self.rows.stage_dispatch(x, phy)
        # Step 4: write count + offset + event id + virtual time into every destination's record.
        seq = self._publish("dispatch", event_id, send_counts)
        return SentDispatch(
            event_id=event_id,
            seq=seq,
            weights=weights,
            send_counts=send_counts,
            send_token=token,
            send_column=column,
        )

    def wait_dispatch(self, sent: SentDispatch) -> tuple[np.ndarray, DispatchInfo, DispatchHandle]:
        """Steps 5-7 of `dispatch`: what `dispatch` returns, for the issued `sent`."""
        if sent.seq != self._seq["dispatch"]:
            raise XcclError(
                f"die rank {self.me}: wait for dispatch {sent.seq} (event {sent.event_id}); "
                f"the last one issued was {self._seq['dispatch']}"
            )
        recv_x, perm, info, recv_counts = self._receive_dispatch(sent.event_id, sent.seq)
        handle = DispatchHandle(
            event_id=sent.event_id,
            seq=sent.seq,
            buffer_id=id(self),
            weights=sent.weights,
            send_counts=sent.send_counts,
            send_token=sent.send_token,
            send_column=sent.send_column,
            recv_counts=recv_counts,
            recv_perm=perm,
        )
        return recv_x, info, handle

    def _receive_dispatch(self, event_id: int, seq: int):
        """Steps 5-7 of dispatch: our rows recv_x [R, hidden] (self.dtype, decoded) in slot order,
        perm [R] (the member-major position of each), DispatchInfo, recv_counts [num_members]."""
        # Step 5: poll our metadata until every die has reported (zero rows included).
        bodies = self._wait_records("dispatch", event_id, seq)
        recv_counts = bodies["count"].astype(np.int64)
        offsets = bodies["offset"].astype(np.int64)
        # Step 6-7: pull the index rows, order them by slot, then pull our rows straight
        # into that order.
        index = self.rows.pull_dispatch_index(recv_counts, offsets)
        perm, info = self._dispatch_info(event_id, index, recv_counts)
        rows = self.rows.pull_dispatch_rows(recv_counts, offsets, perm)
        self._pull_time(rows.nbytes + index.nbytes)
        decoded = decode_rows(
            rows, hidden=self.layout.hidden, use_int8=self.layout.use_int8, dtype=self.dtype
        )
        return decoded, perm, info, recv_counts

    def _dispatch_info(
        self, event_id: int, index: np.ndarray, recv_counts: np.ndarray
    ) -> tuple[np.ndarray, DispatchInfo]:
        """perm [R]: the pulled rows in slot order, and their origins; refuses slots not ours."""
        src_member = np.repeat(np.arange(len(self.members)), recv_counts)  # [R] as pulled
        perm = np.lexsort((index["column"], index["token"], src_member, index["slot"]))
        slots = index["slot"].astype(np.int64)
        local = self.local_index[np.where((slots >= 0) & (slots < len(self.slot_owner)), slots, -1)]
        if (local < 0).any():
            raise XcclError(
                f"die rank {self.me}: dispatch event {event_id} delivered rows for "
                f"slots {sorted(set(slots[local < 0].tolist()))} this die does not host"
            )
        return perm, DispatchInfo(
            local_slots=self.local_slots,
            num_rows_per_slot=np.bincount(local, minlength=len(self.local_slots)),
            src_rank=np.asarray(self.members, np.int64)[src_member[perm]],
            src_token=index["token"][perm].astype(np.int64),
            src_column=index["column"][perm].astype(np.int64),
        )

    # -- combine --------------------------------------------------------------------------------
    def combine(self, expert_out: np.ndarray, handle: DispatchHandle) -> np.ndarray:
        """Send expert outputs home and sum each token's columns, weighted, in column order.

        expert_out: [R, hidden] aligned with the recv_x of `handle`'s dispatch.
        Returns y: [T, hidden] float64 for this die's T dispatched tokens (summed in float64
        whatever the row dtype: the rows are a wire format).
        """
        return self.wait_combine(self.issue_combine(expert_out, handle))

    def issue_combine(self, expert_out: np.ndarray, handle: DispatchHandle) -> SentCombine:
        """Steps 1-4 of `combine`: stage and publish, no wait (see `issue_dispatch`)."""
        self._check_handle(expert_out, handle)
        # Step 1-3 (mirror): stage outputs in our combine area, by source die, in the order
        # each source staged them.
        self.rows.stage_combine(expert_out, handle.recv_perm)
        # Step 4: tell each source where its outputs sit.
        seq = self._publish("combine", handle.event_id, handle.recv_counts)
        return SentCombine(handle=handle, seq=seq)

    def wait_combine(self, sent: SentCombine) -> np.ndarray:
        """Steps 5-7 of `combine`: what `combine` returns, for the issued `sent`."""
        handle, seq = sent.handle, sent.seq
        if seq != self._seq["combine"]:
            raise XcclError(
                f"die rank {self.me}: wait for combine {seq} (event {handle.event_id}); "
                f"the last one issued was {self._seq['combine']}"
            )
        # Step 5: wait for every die's record; step 6-7: pull our rows' outputs back.
        bodies = self._wait_records("combine", handle.event_id, seq)
        counts = bodies["count"].astype(np.int64)
        if not np.array_equal(counts, handle.send_counts):
            raise XcclError(
                f"die rank {self.me}: combine event {handle.event_id} returns {counts.tolist()} "
                f"rows per die, dispatch sent {handle.send_counts.tolist()}"
            )
        outs = self.rows.pull_combine(counts, bodies["offset"].astype(np.int64))
        self._pull_time(outs.nbytes)
        return weighted_column_sum(outs, handle.send_token, handle.send_column, handle.weights)

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
            raise ValueError(
                f"die rank {self.me}: resync to {dispatches} dispatches, {combines} "
                f"combines would go back from {self.publication_state()}"
            )
        self._seq = {"dispatch": dispatches, "combine": combines}

    # -- steps ----------------------------------------------------------------------------------
    def _check_handle(self, expert_out: np.ndarray, handle: DispatchHandle) -> None:
        """Refuse a handle of another buffer, of an older dispatch, or outputs of another shape."""
        if handle.buffer_id != id(self):
            raise XcclError(
                f"die rank {self.me}: combine with a handle of another buffer "
                f"(event {handle.event_id})"
            )
        if handle.seq != self._seq["dispatch"] or self._seq["combine"] >= handle.seq:
            raise XcclError(
                f"die rank {self.me}: combine with the handle of dispatch "
                f"{handle.seq} (event {handle.event_id}); the last dispatch was "
                f"{self._seq['dispatch']} and combines done {self._seq['combine']}"
            )
        if expert_out.shape != (len(handle.recv_perm), self.layout.hidden):
            raise ValueError(
                f"die rank {self.me}: expert_out {expert_out.shape} != "
                f"({len(handle.recv_perm)}, {self.layout.hidden}) rows received"
            )

    def _check_batch(self, x, topk_idx, topk_weights, event_id, log2phy, shared_slots):
        layout, (num_tokens, top_k) = self.layout, topk_idx.shape
        if num_tokens > layout.max_tokens:
            raise BufferTooSmall(
                f"die rank {self.me}: dispatch of {num_tokens} tokens > "
                f"max_tokens_per_die({layout.max_tokens}) (event {event_id});"
                " nothing was sent"
            )
        num_columns = top_k + (1 if shared_slots else 0)
        if (
            x.shape != (num_tokens, layout.hidden)
            or topk_weights.shape != topk_idx.shape
            or num_columns != layout.num_columns
        ):
            raise ValueError(
                f"die rank {self.me}: x {x.shape}, topk_idx {topk_idx.shape}, "
                f"topk_weights {topk_weights.shape}, {len(shared_slots)} shared "
                f"slots do not fit hidden {layout.hidden} and "
                f"{layout.num_columns} columns"
            )
        if topk_idx.size and (topk_idx.max() >= len(log2phy) or topk_idx.min() < -1):
            raise ValueError(f"die rank {self.me}: topk_idx outside -1..{len(log2phy) - 1}")
        phy = select_slots(topk_idx, log2phy, shared_slots, self.me)
        return phy, combine_weights(topk_idx, topk_weights, num_columns)

    def _publish(self, kind: str, event_id: int, counts: np.ndarray) -> int:
        """Tell each member how many rows we staged for it and where: one record each. The fault
        hook fires first: staged, not yet published, so every peer waits for us."""
        if self.fault_hook is not None:
            self.fault_hook(kind, event_id)
        seq = self._seq[kind] = self._seq[kind] + 1
        bodies = np.zeros(len(self.members), ROWS_RECORD)  # one per member: Puts in flight
        bodies["event_id"], bodies["count"] = event_id, counts
        bodies["offset"], bodies["vtime_ns"] = np.cumsum(counts) - counts, self.clock.now_ns
        self._fans[kind][0].publish(bodies.view(np.uint8).reshape(len(bodies), -1), seq)
        return seq

    def _bind_records(self, kind: str) -> tuple[FanOut, FanIn]:
        """Our record in every member's window, and every member's in ours, for `kind`."""
        at = self.layout.record_offset
        out = [RecordAt(r, at(r, kind, self.me_idx)) for r in self.members]
        into = [RecordAt(r, at(self.me, kind, i)) for i, r in enumerate(self.members)]
        meeting = self.mem.wake_words.meeting(self.members)  # every member waits for every one
        return (
            FanOut.records(self.mem, out, ROWS_RECORD, wakes=meeting is None),
            FanIn(self.mem, into, ROWS_RECORD, meeting=meeting),
        )

    def _wait_records(self, kind: str, event_id: int, seq: int) -> np.ndarray:
        """Every member's record of call `seq`: [num_members] ROWS_RECORD."""
        expected = Expected(stage=kind, event_id=event_id, doorbell=seq, call=f"call {seq}")
        fan_in, log = self._fans[kind][1], self.wait_log
        if log is None:
            bodies = fan_in.wait(expected, timeout_s=self.timeout_s, interrupt=self.interrupt)
            self._arrive(bodies)
            return bodies
        started_s, vstarted_ns = time.perf_counter(), self.clock.now_ns
        try:  # logged however the wait ends (a rollback's or the fence's exception too)
            bodies = fan_in.wait(expected, timeout_s=self.timeout_s, interrupt=self.interrupt)
            self._arrive(bodies)
        finally:
            log.add(f"{kind} wait", started_s, vstarted_ns, self.clock.now_ns, event=event_id)
        return bodies

    def _arrive(self, bodies: np.ndarray) -> None:
        """Virtual time: the last peer's record lands (with a link model, after its latency)."""
        latency_ns = 0.0 if self.link is None else self.link.latency_ns()
        self.clock.arrive(float(bodies["vtime_ns"].max(initial=0.0)) + latency_ns)

    def _pull_time(self, nbytes: int) -> None:
        """Virtual time our link takes to pull the bytes (none: the caller prices them)."""
        if self.link is not None:
            self.clock.advance(self.link.serialization_ns(nbytes, num_cores=self.num_cores))
