"""The expert side of A2E/E2A (xccl/afd/buffer.py, xDeepServe §3.3, Fig. 8): A2E' and E2A' steps
3-8.

Non-blocking steps, so a persistent loop (xccl/afd/loop.py) can drive receive / compute / send as
concurrent stages: a trampoline forwards its attention die's tokens as rows to every expert die
(`try_forward`, steps 3-4); every expert die pulls its rows once every sender wrote
(`try_receive`, step 5) and answers each sender (`send_back`, steps 6-7); a trampoline returns a
call to its attention die once every expert die answered (`try_return`, step 8). Scattering rows
to the expert dies and gathering their outputs back also serve an attention die of the direct
variant (xccl/afd/buffer.py a2e / e2a). AfdBuffer mixes this in and owns the attributes declared
below.
"""

from __future__ import annotations

import numpy as np

from xccl.afd.records import AfdCall, AfdRecords
from xccl.afd.rows import AfdRows, Received, ScatterPlan
from xccl.errors import XcclError
from xccl.moe_layout import AfdLayout
from xccl.recovery.faults import FaultHook


class AfdExpertSide:
    """Expert-side steps of AfdBuffer and the row scatter / gather both sides use."""

    layout: AfdLayout
    records: AfdRecords
    rows: AfdRows
    me: int
    idx: int  # our number among the attention dies, or among the expert dies
    group: int  # our attention group (an expert die: the group it is the trampoline of)
    is_trampoline: bool
    use_trampolines: bool
    local_slots: tuple[int, ...]
    dest_of_slot: np.ndarray  # [slots] -> expert idx
    num_routed_slots: int
    fault_hook: FaultHook | None
    _forwarded: dict[int, tuple[np.ndarray, np.ndarray, ScatterPlan]]

    # -- who talks to whom ----------------------------------------------------------------------
    def domain_attention(self, domain: int) -> tuple[int, ...]:
        g = self.layout.group_size
        return self.layout.attention[domain * g : (domain + 1) * g]

    def senders(self, call: AfdCall) -> tuple[int, ...]:
        """Ranks that scatter rows to the expert dies for this call."""
        if self.use_trampolines:
            return self.layout.experts[: self.layout.group_size]
        return self.domain_attention(call.domain)

    # -- expert side (non-blocking steps for the persistent loop) --------------------------------
    def try_forward(self, call: AfdCall) -> bool:
        """Trampoline, A2E' steps 3-4: if our attention die's tokens arrived, pull them, expand
        them to rows and scatter the rows to every expert die. False = not yet."""
        self.records.take(call)
        layout, lane = self.layout, call.lane
        src = self.domain_attention(call.domain)[self.group]
        if src < 0:  # a lost attention die (ranks/recovery/scale_down.py): no tokens, zero rows out
            if self._forwarded:
                # As its attention die would: a lane is reused only after the calls before
                # returned (the reuse argument in xccl/afd/buffer.py), else records overwrite
                # records.
                self.records.waiting_for = f"die rank {self.me}: earlier calls to return"
                self.records.missing = ("A2E", call.event_id, ())  # no peer's record missing
                return False
            x = np.empty((0, layout.hidden), self.rows.dtype)
            route = np.empty((0, layout.num_columns), np.int64)
        else:
            src_idx = layout.attention.index(src)
            bodies = self.records.ready(call, "a2e_records", [(src, src_idx)], "A2E")
            if bodies is None:
                return False
            x, route = self.rows.pull_tokens(src, lane, bodies)
        token, column = np.nonzero(route >= 0)  # token-major
        plan = self._scatter(
            x, token, column, route[token, column], call, "fwd_records", self.group, fault_op="a2e"
        )
        self._forwarded[call.call] = (token, column, plan)
        return True

    def try_receive(self, call: AfdCall) -> Received | None:
        """Every expert die, A2E' step 5: once every sender's record arrived, pull our rows."""
        self.records.take(call)
        layout, lane = self.layout, call.lane
        senders = self.senders(call)
        region = "fwd_records" if self.use_trampolines else "a2e_records"
        writer_idx = (
            range(len(senders))
            if self.use_trampolines
            else [layout.attention.index(r) for r in senders]
        )
        bodies = self.records.ready(call, region, list(zip(senders, writer_idx)), "A2E'")
        if bodies is None:
            return None
        if not self.is_forwarding:  # a trampoline's A2E fault fires in try_forward
            self._fault("a2e", call)
        x, index = self.rows.pull_scattered(senders, lane, bodies)
        if len(index) and not np.isin(index["slot"], self.local_slots).all():
            raise XcclError(
                f"die rank {self.me}: A2E' event {call.event_id} delivered rows for "
                f"slots {sorted(set(index['slot'].tolist()) - set(self.local_slots))}"
                " this die does not host"
            )
        return Received(
            call=call,
            x=x,
            slot=index["slot"].astype(np.int64),
            token=index["token"].astype(np.int64),
            column=index["column"].astype(np.int64),
            sender_counts=(bodies["count"] + bodies["shared_count"]).astype(np.int64),
        )

    def send_back(self, received: Received, out: np.ndarray) -> None:
        """E2A' steps 6-7 (E2A when direct): stage outputs [R, hidden] aligned with received.x,
        by sender, and write a record into every sender (zero rows included)."""
        call = received.call
        self.records.take(call)
        if out.shape != received.x.shape:
            raise ValueError(
                f"die rank {self.me}: outputs {out.shape} != rows received "
                f"{received.x.shape} (event {call.event_id})"
            )
        self.rows.stage_outputs("out_rows", call.lane, out)
        if not self.is_forwarding:  # a trampoline's E2A fault fires in try_return
            self._fault("e2a", call)
        counts = received.sender_counts
        offsets = np.cumsum(counts) - counts
        self.records.publish(
            self.senders(call), "back_records", call, self.idx, count=counts, offset=offsets
        )

    def try_return(self, call: AfdCall) -> bool:
        """Trampoline, E2A step 8: once every expert die answered (E2A' step 7), pull the outputs,
        restage them in our attention die's row order, and write it one record."""
        self.records.take(call)
        token, column, plan = self._forwarded[call.call]
        staged = self._gather_back(call, plan, blocking=False)
        if staged is None:
            return False
        self._fault("e2a", call)
        del self._forwarded[call.call]
        outs = np.empty_like(staged)
        outs[plan.order] = staged  # back to the attention die's order
        dst = self.domain_attention(call.domain)[self.group]
        if dst >= 0:  # a lost attention die (-1) waits for nothing
            self.rows.stage_outputs("ret_rows", call.lane, outs)
            self.records.publish([dst], "back_records", call, self.idx, count=len(token))
        return True

    @property
    def is_forwarding(self) -> bool:
        """A trampoline of the trampoline variant (forwards A2E', returns E2A)."""
        return self.is_trampoline and self.use_trampolines

    def _fault(self, op: str, call: AfdCall) -> None:
        if self.fault_hook is not None:
            self.fault_hook(op, call.event_id)

    # -- steps ----------------------------------------------------------------------------------
    def _scatter(
        self, x, token, column, slot, call: AfdCall, region: str, writer_idx: int, *, fault_op: str
    ) -> ScatterPlan:
        """Stage rows [R] (x[token]) by destination expert die, routed rows (INT8 if enabled)
        then shared rows, and write (counts, offsets) into every expert die's `region`."""
        plan = self.rows.stage_scatter(
            call.lane,
            x,
            token,
            column,
            slot,
            self.dest_of_slot[slot],
            slot >= self.num_routed_slots,
        )
        self._fault(fault_op, call)
        # Step 4 (A2E'; direct: step 2): a record per expert die, zero rows included.
        self.records.publish(
            self.layout.experts,
            region,
            call,
            writer_idx,
            count=plan.counts,
            offset=np.cumsum(plan.counts) - plan.counts,
            shared_count=plan.shared_counts,
            shared_offset=np.cumsum(plan.shared_counts) - plan.shared_counts,
        )
        return plan

    def _gather_back(self, call: AfdCall, plan: ScatterPlan, *, blocking: bool):
        stage = "E2A'" if self.use_trampolines else "E2A"
        return self.rows.gather_back(call, plan, stage, blocking=blocking)
