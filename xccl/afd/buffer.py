"""A2E / E2A for disaggregated MoE-attention, with trampoline forwarding (xDeepServe §3.3, Fig. 8).

Attention dies (G per DP domain, one domain active per call) and expert dies live on separate
dies. With trampolines, expert die g is the trampoline of attention group g of every domain:
    A2E   (step 1-2)  the attention die stages each token ONCE (full precision) and its routing in
                      its own window and writes ONE record into its trampoline;
    A2E'  (step 3-5)  the trampoline pulls them, expands each token to one row per chosen expert
                      slot (INT8 if enabled; shared-expert rows full precision), stages the rows in
                      its own window by destination expert die and writes a record into every
                      expert die; every expert die waits for all G trampolines and pulls its rows;
    E2A'  (step 6-7)  each expert die stages its outputs by source trampoline and writes a record
                      into every trampoline, which pulls its rows' outputs back;
    E2A   (step 8-9)  the trampoline restages them in its attention die's row order and writes ONE
                      record into it; the attention die pulls them and sums each token's columns,
                      weighted, in column order (the shared column, weight 1, last).
So an attention die writes 1 record per call instead of one per expert die (the direct variant,
`use_trampolines=False`: attention dies scatter straight to the expert dies, which answer each
attention die). Any ratio works: E >= G expert dies, E not a multiple of G, dedicated shared dies.

Calls and lanes: every participant numbers the calls alike (`AfdCall.call`, increasing); doorbell
= call + 1. Every region exists once per lane = (DP domain, microbatch). Why no acks: a lane is
reused by the same domain's same microbatch one layer later, and its attention dies issue that
A2E only after their E2A of the lane completed, which needs (a) the trampoline to have pulled the
tokens and collected every expert die's outputs, so every expert die had pulled the forwarded
rows, and (b) every trampoline to have pulled its outputs from every expert die before the next
A2E' of the lane reaches that expert die. In the direct variant (a)-(b) hold with the attention
dies in the trampolines' place.

Records (write, poll, counters) live in xccl/afd/records.py, staging and pulling rows in
xccl/afd/rows.py. The expert side (xccl/afd/expert.py) is non-blocking (`try_forward`,
`try_receive`, `send_back`, `try_return`) so a persistent loop (xccl/afd/loop.py) can drive
receive / compute / send as concurrent stages.

Recovery (xccl/recovery/faults.py): the doorbells are the caller's call numbers, so after an
abandoned
attempt the caller never reuses one; publication_state() is 1 + the highest call this die took
part in, resync moves it (and a floor below which calls are refused) to the max over all dies.
Fault hooks fire once per call per die: "a2e" on an attention die after staging, before its
record; on a trampoline in try_forward, on other expert dies in try_receive, when the call's
records arrived; "e2a" on a trampoline in try_return, on other expert dies in send_back (after
staging, before the records), on an attention die in e2a before waiting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from mpi4py import MPI

from xccl.afd.expert import AfdExpertSide
from xccl.afd.records import AfdCall, AfdRecords
from xccl.afd.rows import A2EHandle, AfdRows, ScatterPlan
from xccl.agreement import WindowAgreement
from xccl.errors import BufferTooSmall, XcclError
from xccl.gmem import DieMemory
from xccl.moe_layout import AfdLayout
from xccl.recovery.faults import FaultHook, Interrupt, RecoveryHooks
from xccl.routing import combine_weights, select_slots, weighted_column_sum
from xccl.vclock import LinkModel, VirtualClock
from xccl.wait_log import WaitLog


def _check_window(mem: DieMemory, layout: AfdLayout, role: str, dtype) -> None:
    """Refuse a window too small for the role's area, or rows of another itemsize."""
    need = layout.base[mem.rank] + layout.area_bytes(role)
    if mem.nbytes < need:
        raise BufferTooSmall(
            f"rank {mem.rank}: window of {mem.nbytes} B < the {need} B the A2E/E2A layout needs"
        )
    if np.dtype(dtype).itemsize != layout.itemsize:
        raise ValueError(f"dtype {np.dtype(dtype)} != layout itemsize {layout.itemsize}")


@dataclass(frozen=True, kw_only=True)
class AfdOptions:
    """What an AfdBuffer is built with besides its window, layout and slots: num_routed_slots,
    the slots before the shared ones; use_trampolines, A2E through the trampolines (else
    direct); dtype, the rows' wire dtype; clock, the die's virtual clock; link, the cost
    model's link; num_cores, AIV cores per transfer; timeout_s, every wait's deadline;
    wait_log, where the attention side's E2A wait is logged for the trace (None: tracing off)."""

    num_routed_slots: int
    use_trampolines: bool
    dtype: np.dtype
    clock: VirtualClock
    link: LinkModel | None
    num_cores: int
    timeout_s: float
    wait_log: WaitLog | None


class AfdBuffer(AfdExpertSide):
    """A2E/E2A on this die's window, for an attention or an expert die (one per window)."""

    def __init__(
        self,
        mem: DieMemory,
        layout: AfdLayout,
        slot_owner: Sequence[int],
        *,
        num_routed_slots: int,
        use_trampolines: bool = True,
        dtype=np.float64,
        clock: VirtualClock | None = None,
        link: LinkModel | None = None,
        num_cores: int = 2,
        timeout_s: float = 60.0,
        wait_log: WaitLog | None = None,
    ) -> None:
        """wait_log: where the attention side's E2A wait is logged for the caller's trace
        (xccl/wait_log.py; None, the default: tracing off, nothing logged)."""
        mem.claim("afd")
        self.role = layout.role_of(mem.rank)
        _check_window(mem, layout, self.role, dtype)
        self.mem, self.layout, self.me = mem, layout, mem.rank
        self._map_slots(slot_owner, num_routed_slots)
        self.use_trampolines = use_trampolines
        self.dtype, self.clock, self.link = np.dtype(dtype), clock or VirtualClock(), link
        self.num_cores, self.timeout_s = num_cores, timeout_s
        self.records = AfdRecords(
            mem, layout, clock=self.clock, link=link, num_cores=num_cores, timeout_s=timeout_s
        )
        self.counters = self.records.counters
        self.rows = AfdRows(mem, layout, self.records, dtype)
        self.agreement = WindowAgreement(mem, layout, timeout_s=timeout_s)  # between iterations
        self._place_in_group()
        self._forwarded: dict[int, tuple[np.ndarray, np.ndarray, ScatterPlan]] = {}
        self.fault_hook: FaultHook | None = None  # (op, event_id), may raise InjectedFault
        self.wait_log = wait_log
        self.options = AfdOptions(
            num_routed_slots=num_routed_slots,
            use_trampolines=use_trampolines,
            dtype=self.dtype,
            clock=self.clock,
            link=link,
            num_cores=num_cores,
            timeout_s=timeout_s,
            wait_log=wait_log,
        )

    def _map_slots(self, slot_owner: Sequence[int], num_routed_slots: int) -> None:
        """Which expert die hosts each slot, and which slots are ours."""
        self.slot_owner = np.asarray(slot_owner, np.int64)  # [slots] -> expert rank
        self.expert_of_rank = {r: i for i, r in enumerate(self.layout.experts)}
        self.dest_of_slot = np.array(
            [self.expert_of_rank.get(int(r), -1) for r in self.slot_owner], np.int64
        )  # [slots] -> expert idx; -1: a lost expert die's slot, which no routing picks
        self.num_routed_slots = num_routed_slots
        self.local_slots = tuple(int(s) for s in np.flatnonzero(self.slot_owner == self.me))

    def _place_in_group(self) -> None:
        """Our number among our role's dies, our attention group, whether we are a trampoline."""
        layout = self.layout
        self.idx = (
            layout.attention.index(self.me)
            if self.role == "attention"
            else layout.experts.index(self.me)
        )
        self.group = self.idx % layout.group_size if self.role == "attention" else self.idx
        self.is_trampoline = self.role == "expert" and self.idx < layout.group_size

    @property
    def interrupt(self) -> Interrupt | None:
        """Called on every turn of every wait (the records' polls, the expert loop)."""
        return self.records.interrupt

    @interrupt.setter
    def interrupt(self, interrupt: Interrupt | None) -> None:
        self.records.interrupt = interrupt

    def rebuilt(self, comm: MPI.Comm) -> AfdBuffer:
        """This buffer over `comm` (the survivors: a sub-communicator of the one this window
        spans) on a window of its own, with the same options and recovery hooks: the layout's
        ranks are the survivors' ranks in `comm`, each area at the window's start; a lost
        attention die keeps its place as rank -1, a lost expert die leaves the layout and its
        slots are owned by nobody (-1). Collective over `comm`. This buffer is never used again
        (nor freed: its window spans the lost dies)."""
        before = self.mem.comm  # the communicator the layout numbers ranks in
        in_before = MPI.Group.Translate_ranks(comm.group, list(range(comm.size)), before.group)
        to_new = {old: new for new, old in enumerate(in_before)}
        layout = replace(
            self.layout,
            attention=tuple(to_new.get(r, -1) for r in self.layout.attention),
            experts=tuple(to_new[r] for r in self.layout.experts if r in to_new),
            base=(0,) * comm.size,
        )
        nbytes = -(-layout.area_bytes(self.role) // 8) * 8
        owners = np.array([to_new.get(int(r), -1) for r in self.slot_owner], np.int64)
        afd = AfdBuffer(DieMemory(comm, nbytes), layout, owners, **vars(self.options))
        afd.set_recovery(RecoveryHooks(interrupt=self.interrupt, fault_hook=self.fault_hook))
        return afd

    def set_recovery(self, hooks: RecoveryHooks) -> None:
        """Install the recovery hooks (once, by the die's recomputer; xccl/recovery/faults.py)."""
        self.interrupt, self.fault_hook = hooks.interrupt, hooks.fault_hook

    @property
    def waiting_for(self) -> str:
        """Whom the last unmet poll waits for (die, stage, event, missing peers)."""
        return self.records.waiting_for

    # -- attention side -------------------------------------------------------------------------
    def a2e(
        self,
        x: np.ndarray,
        topk_idx: np.ndarray,
        topk_weights: np.ndarray,
        call: AfdCall,
        *,
        log2phy: Sequence[Sequence[int]],
        shared_slots: Sequence[int] = (),
    ) -> A2EHandle:
        """Send this attention die's tokens toward their experts; returns at once (no wait).

        x: [T, hidden] rows. topk_idx: [T, K] int logical experts, -1 = none. topk_weights: [T, K].
        log2phy: [E] physical slots per logical expert. shared_slots: slots of the shared expert
        (column K, weight 1), spread by (rank + token). Zero tokens are fine: every attention die
        of the active domain must call it."""
        self.records.take(call)
        self._check_a2e(x, topk_idx, shared_slots, call)
        phy = select_slots(topk_idx, log2phy, shared_slots, self.me)  # [T, C]
        weights = combine_weights(topk_idx, topk_weights, self.layout.num_columns)
        token, column = np.nonzero(phy >= 0)  # token-major [R]
        scatter = None
        if self.use_trampolines:
            self._send_to_trampoline(x, phy, call)
        else:
            # Direct: expand to rows and scatter them to every expert die (a record each).
            scatter = self._scatter(
                np.asarray(x, self.dtype),
                token,
                column,
                phy[token, column],
                call,
                "a2e_records",
                self.idx,
                fault_op="a2e",
            )
        self.counters.calls += 1
        return A2EHandle(
            call=call, weights=weights, row_token=token, row_column=column, scatter=scatter
        )

    def _check_a2e(
        self, x: np.ndarray, topk_idx: np.ndarray, shared_slots: Sequence[int], call: AfdCall
    ) -> None:
        """Refuse more tokens than the layout holds, or shapes that do not fit it."""
        layout, num_tokens = self.layout, len(x)
        if num_tokens > layout.max_tokens:
            raise BufferTooSmall(
                f"die rank {self.me}: A2E of {num_tokens} tokens > max_tokens_per"
                f"_die({layout.max_tokens}) (event {call.event_id}); nothing sent"
            )
        if (
            x.shape != (num_tokens, layout.hidden)
            or topk_idx.shape != (num_tokens, layout.top_k)
            or bool(shared_slots) != layout.has_shared
        ):
            raise ValueError(
                f"die rank {self.me}: x {x.shape}, topk_idx {topk_idx.shape}, "
                f"{len(shared_slots)} shared slots do not fit hidden {layout.hidden},"
                f" top-k {layout.top_k}, shared column {layout.has_shared}"
            )

    def _send_to_trampoline(self, x: np.ndarray, phy: np.ndarray, call: AfdCall) -> None:
        """Trampoline variant: tokens [T, hidden] and their slots phy [T, C] to our trampoline."""
        # Step 1 (Fig. 8 A2E): each token once, full precision, and its slots, in our window.
        self.rows.stage_tokens(call.lane, x, phy)
        self._fault("a2e", call)
        # Step 2: one record into our trampoline (expert die number = our group).
        tramp = self.layout.experts[self.group]
        self.records.publish([tramp], "a2e_records", call, self.idx, count=len(x))

    def e2a(self, handle: A2EHandle) -> np.ndarray:
        """Wait for this call's expert outputs and sum them, weighted, in column order: returns
        y [T, hidden] float64 (summed in float64 whatever the row dtype)."""
        layout, call = self.layout, handle.call
        self.records.take(call)
        self._fault("e2a", call)
        num_rows = len(handle.row_token)
        if self.use_trampolines:
            # Step 8-9 (Fig. 8 E2A): one record from our trampoline, then pull our rows' outputs.
            tramp = layout.experts[self.group]
            back, log = [(tramp, self.group)], self.wait_log
            if log is None:
                bodies = self.records.wait(call, "back_records", back, "E2A")
            else:
                started_s, vstarted_ns = time.perf_counter(), self.clock.now_ns
                try:  # logged however the wait ends
                    bodies = self.records.wait(call, "back_records", back, "E2A")
                finally:
                    now_ns = self.clock.now_ns
                    log.add("e2a wait", started_s, vstarted_ns, now_ns, event=call.event_id)
            if int(bodies["count"][0]) != num_rows:
                raise XcclError(
                    f"die rank {self.me}: E2A event {call.event_id} returns "
                    f"{int(bodies['count'][0])} rows, A2E sent {num_rows}"
                )
            outs = self.rows.pull_outputs("ret_rows", call.lane, [tramp], bodies)
        else:
            log = self.wait_log
            if log is None:
                staged = self._gather_back(call, handle.scatter, blocking=True)
            else:
                started_s, vstarted_ns = time.perf_counter(), self.clock.now_ns
                try:  # logged however the wait ends
                    staged = self._gather_back(call, handle.scatter, blocking=True)
                finally:
                    now_ns = self.clock.now_ns
                    log.add("e2a wait", started_s, vstarted_ns, now_ns, event=call.event_id)
            outs = np.empty_like(staged)
            outs[handle.scatter.order] = staged
        return weighted_column_sum(outs, handle.row_token, handle.row_column, handle.weights)

    # -- recovery -------------------------------------------------------------------------------
    @property
    def call_floor(self) -> int:
        """The lowest call number this die accepts (raised by resync)."""
        return self.records.call_floor

    def publication_state(self) -> tuple[int]:
        """(1 + the highest call number this die took part in,)."""
        return (self.records.next_call,)

    def abandon(self) -> None:
        """Complete outstanding RMA and forget the calls forwarded but not returned."""
        self.mem.flush_all()
        self._forwarded.clear()

    def resync(self, state) -> None:
        """Abandon, then refuse every call number below state[0] (the max over all dies): a
        record of the abandoned attempt can never ring for a call of the next one."""
        self.abandon()
        (next_call,) = state
        self.records.resync_calls(int(next_call))
