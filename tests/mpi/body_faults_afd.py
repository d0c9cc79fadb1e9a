"""A2E/E2A iterations with the expert dies' persistent loop recover from injected faults, with
trampolines and without (tests/mpi/faults_common.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from faults_common import (
    EXPERTS_PER_DIE,
    HIDDEN,
    MAX_TOKENS,
    POLL_TIMEOUT_S,
    TOP_K,
    batch,
    comm,
    counting,
    expert_fn,
    fired_attempts,
)
from faults_common import recovery as recovery  # the fixture; the alias re-exports it to pytest

from xccl.afd.buffer import AfdBuffer, AfdCall
from xccl.afd.loop import ExpertLoop
from xccl.gmem import DieMemory
from xccl.moe_layout import AfdLayout
from xccl.recovery.faults import RecoveryHooks
from xccl.reference import e2a_reference
from xds_mpi.config.schema import FaultsConfig
from xds_mpi.execution.faults import FaultPlan

NUM_AFD_ITERATIONS, NUM_AFD_LAYERS, NUM_MICROBATCHES = 7, 2, 2


class AfdEvents:
    """The layer of an event id of `AfdDeployment.calls`."""

    def layer_of_event(self, event_id):
        return (event_id // 100) % 10


class AfdDeployment:
    """D domains x G attention dies, E expert dies (EXPERTS_PER_DIE slots each); ranks beyond
    them are idle but vote."""

    def __init__(self, trampolines):
        self.domains, self.groups, num_experts = {2: (1, 1, 1), 4: (1, 2, 2)}.get(
            comm.size, (2, 2, 3)
        )
        self.attention = tuple(range(self.domains * self.groups))
        self.experts = tuple(range(len(self.attention), len(self.attention) + num_experts))
        slot_owner = [r for r in self.experts for _ in range(EXPERTS_PER_DIE)]
        self.log2phy = [(s,) for s in range(len(slot_owner))]
        self.layout = self._layout()
        self.role = (
            "attention"
            if comm.rank in self.attention
            else "expert"
            if comm.rank in self.experts
            else "idle"
        )
        self.mem = DieMemory(comm, self.layout.area_bytes(self.role) if self.role != "idle" else 0)
        self.buf = (
            AfdBuffer(
                self.mem,
                self.layout,
                slot_owner,
                num_routed_slots=len(slot_owner),
                use_trampolines=trampolines,
                timeout_s=POLL_TIMEOUT_S,
            )
            if self.role != "idle"
            else None
        )
        self.buffers = [self.buf] if self.buf else []
        self.next_call = 0  # the same on every die of the deployment

    def _layout(self):
        return AfdLayout(
            attention=self.attention,
            experts=self.experts,
            group_size=self.groups,
            base=(0,) * comm.size,
            num_lanes=self.domains * NUM_MICROBATCHES,
            hidden=HIDDEN,
            max_tokens=MAX_TOKENS,
            top_k=TOP_K,
            has_shared=False,
            itemsize=8,
            use_int8=False,
        )

    def table(self):
        a, e = self.attention, self.experts
        return [
            dict(die=a[-1], op="a2e", layer=0, iteration=1),
            dict(die=e[0], op="a2e", layer=1, iteration=2),  # trampoline: try_forward
            dict(die=e[-1], op="e2a", layer=0, iteration=3),
            dict(die=e[0], op="e2a", layer=1, iteration=4),  # trampoline: try_return
            dict(die=a[0], op="e2a", layer=1, iteration=5),
        ]  # experts may be done

    def calls(self, iteration):
        """Layer-major, then domain, then microbatch; event ids repeat on a re-execution, call
        numbers never do."""
        calls = []
        for layer, domain, mb in itertools.product(
            range(NUM_AFD_LAYERS), range(self.domains), range(NUM_MICROBATCHES)
        ):
            calls.append(
                AfdCall(
                    call=self.next_call + len(calls),
                    lane=domain * NUM_MICROBATCHES + mb,
                    domain=domain,
                    event_id=1000 * iteration + 100 * layer + 10 * domain + mb,
                )
            )
        return calls

    def serve(self, calls):
        """Attention dies: per layer, every microbatch's A2E, then their E2A -> {event: y}.
        Expert dies: one persistent loop over every call."""
        ys = {}
        if self.role == "attention":
            domain = self.attention.index(comm.rank) // self.groups
            mine = [c for c in calls if c.domain == domain]
            for at in range(0, len(mine), NUM_MICROBATCHES):
                handles = [
                    self.buf.a2e(
                        *batch(comm.rank, c.event_id, len(self.log2phy)), c, log2phy=self.log2phy
                    )
                    for c in mine[at : at + NUM_MICROBATCHES]
                ]
                for h in handles:
                    ys[h.call.event_id] = self.buf.e2a(h)
        elif self.role == "expert":
            ExpertLoop(
                self.buf, lambda call, slot, rows: expert_fn(slot, rows), timeout_s=POLL_TIMEOUT_S
            ).run(calls)
        return ys

    def check(self, ys):
        for event, y in ys.items():
            domain = (event // 10) % 10
            senders = self.attention[domain * self.groups : (domain + 1) * self.groups]
            xs, topks, ws = zip(*(batch(r, event, len(self.log2phy)) for r in senders))
            want = e2a_reference(xs, topks, ws, self.log2phy, (), senders, expert_fn)
            assert np.array_equal(y, want[senders.index(comm.rank)]), f"event {event} differs"

    def close(self):
        comm.Barrier()
        self.mem.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("trampolines", [True, False], ids=["trampoline", "direct"])
def test_a2e_e2a_iterations_recover_from_injected_faults(recovery, trampolines):
    dep = AfdDeployment(trampolines)
    plan = FaultPlan(FaultsConfig(table=dep.table()), comm.rank, AfdEvents())
    raised, ys = [], {}
    for buf in dep.buffers:
        buf.set_recovery(
            RecoveryHooks(interrupt=recovery.interrupt, fault_hook=counting(plan, raised))
        )
    try:
        for it in range(NUM_AFD_ITERATIONS):

            def attempt(k):
                calls = dep.calls(it)
                plan.begin(iteration=it, attempt=k)
                ys.update(dep.serve(calls))
                return len(calls)

            def after_rollback(outcome):  # calls of the abandoned attempt stay unused
                if dep.buf is not None:
                    dep.next_call = dep.buf.call_floor

            num_calls = recovery.run(
                attempt,
                dep.buffers,
                max_retries=2,
                what=f"iteration {it}",
                on_rollback=after_rollback,
            )
            dep.next_call += num_calls  # after run: on_rollback may have moved it
        dep.check(ys)
        if dep.role == "attention":
            domain = dep.attention.index(comm.rank) // dep.groups
            assert len(ys) == NUM_AFD_ITERATIONS * NUM_AFD_LAYERS * NUM_MICROBATCHES
            assert all((event // 10) % 10 == domain for event in ys)
        assert fired_attempts(raised) == [(it, 0) for it in range(1, 6)]
        assert recovery.epoch == 5
    finally:
        dep.close()
