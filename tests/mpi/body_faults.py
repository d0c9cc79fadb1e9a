"""Token recomputation on injected XCCL faults (xDeepServe §6.2 stage 3) at any rank count.

Each test runs iterations of an XCCL workload under a declarative fault table (FaultsConfig rows:
die, op, layer, iteration, times), wraps every iteration as an attempt (notify, interrupt, vote,
resync, re-execute: xccl/recovery.py) and compares every iteration's outputs with the
single-process oracle bit for bit. Inputs depend only on (rank, event id), so a re-execution sends
the same rows with the same event ids. Every wait has the production poll timeout (60 s): a die
deaf to the rollback would fail its test with XcclTimeout, not merely slow it down.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from mpi4py import MPI

from xccl.afd import AfdBuffer, AfdCall
from xccl.afd_loop import ExpertLoop
from xccl.ep import EpBuffer
from xccl.errors import InjectedFault, RetriesExhausted, RollbackRequested
from xccl.faults import RecoveryHooks
from xccl.gmem import DieMemory
from xccl.layout import P2PLayout, all_pairs
from xccl.moe_layout import AfdLayout, EpLayout
from xccl.p2p import P2P
from xccl.recovery import Recovery
from xccl.reference import combine_reference, e2a_reference, tagged_payload
from xds_mpi.config import FaultsConfig
from xds_mpi.faults import FaultPlan, LayerEvents

comm = MPI.COMM_WORLD
LAST = comm.size - 1
POLL_TIMEOUT_S = 60.0
HIDDEN, MAX_TOKENS, TOP_K, EXPERTS_PER_DIE = 8, 8, 2, 2


@pytest.fixture
def recovery():
    rec = Recovery(comm, timeout_s=POLL_TIMEOUT_S)
    yield rec
    comm.Barrier()
    rec.free()


def batch(rank, event, num_experts):
    """Rows that name their source (column 0 = rank, 1 = token); -1 and repeated experts occur."""
    rng = np.random.default_rng((rank, event))
    num_tokens = (rank * 3 + event) % (MAX_TOKENS + 1)
    x = rng.normal(size=(num_tokens, HIDDEN))
    x[:, 0], x[:, 1] = rank, np.arange(num_tokens)
    topk = rng.integers(-1, num_experts, size=(num_tokens, TOP_K))
    return x, topk, rng.random((num_tokens, TOP_K))


def expert_fn(slot, rows):
    return rows * (slot + 1.5) + slot


def fired_attempts(rollbacks):
    """Every die's (iteration, attempt) of the faults it raised, gathered: the distinct ones."""
    return sorted({a for per_die in comm.allgather(rollbacks) for a in per_die})


# -- (a) dispatch / combine -----------------------------------------------------------------------
NUM_ITERATIONS, NUM_LAYERS = 20, 3
EP_TABLE = [
    dict(die=1, op="dispatch", layer=0, iteration=2),  # first layer
    dict(die=0, op="combine", layer=2, iteration=5, code=4),  # last layer
    dict(die=LAST, op="dispatch", layer=1, iteration=9, times=2),  # twice in a row
    dict(die=0, op="dispatch", layer=1, iteration=13),  # two dies at once
    dict(die=1, op="dispatch", layer=1, iteration=13),
    dict(die=1, op="combine", layer=1, iteration=17),
]


EP_EVENTS = LayerEvents(events_per_iteration=10)


def ep_event(iteration, layer):
    return EP_EVENTS.event_id(iteration, layer)


class EpGroup:
    def __init__(self):
        self.slot_owner = [r for r in range(comm.size) for _ in range(EXPERTS_PER_DIE)]
        self.log2phy = [(s,) for s in range(len(self.slot_owner))]
        self.layout = EpLayout(
            members=tuple(range(comm.size)),
            base=(0,) * comm.size,
            hidden=HIDDEN,
            max_tokens=MAX_TOKENS,
            num_columns=TOP_K,
            itemsize=8,
            use_int8=False,
        )
        self.mem = DieMemory(comm, self.layout.area_bytes())
        self.ep = EpBuffer(self.mem, self.layout, self.slot_owner, timeout_s=POLL_TIMEOUT_S)

    def iteration(self, iteration):
        """Every layer's dispatch, experts, combine: [layer] -> y [T, hidden]."""
        ys = []
        for layer in range(NUM_LAYERS):
            event = ep_event(iteration, layer)
            x, topk, w = batch(comm.rank, event, len(self.log2phy))
            recv_x, info, handle = self.ep.dispatch(x, topk, w, event, log2phy=self.log2phy)
            slot_of_row = np.repeat(info.local_slots, info.num_rows_per_slot)
            out = np.empty_like(recv_x)
            for slot in info.local_slots:
                out[slot_of_row == slot] = expert_fn(slot, recv_x[slot_of_row == slot])
            ys.append(self.ep.combine(out, handle))
        return ys

    def oracle(self, iteration):
        ys = []
        for layer in range(NUM_LAYERS):
            xs, topks, ws = zip(
                *(batch(r, ep_event(iteration, layer), len(self.log2phy)) for r in range(comm.size))
            )
            ys.append(
                combine_reference(xs, topks, ws, self.log2phy, (), range(comm.size), expert_fn)[
                    comm.rank
                ]
            )
        return ys

    def close(self):
        comm.Barrier()
        self.mem.free()


@pytest.mark.mpi(min_size=2)
def test_dispatch_combine_iterations_recover_from_injected_faults(recovery):
    group = EpGroup()
    ep, plan = group.ep, FaultPlan(FaultsConfig(table=EP_TABLE), comm.rank, EP_EVENTS)
    ep.set_recovery(RecoveryHooks(interrupt=recovery.interrupt, fault_hook=plan.check))
    outputs, raised, outcomes = {}, [], []
    try:
        for it in range(NUM_ITERATIONS):
            for attempt in itertools.count():  # the coordinator's steps, spelled out
                assert attempt <= 2, f"iteration {it} still failing at attempt {attempt}"
                plan.begin(iteration=it, attempt=attempt)
                fault = None
                try:
                    outputs[it] = group.iteration(it)
                except InjectedFault as exc:
                    fault = exc
                    raised.append((it, attempt))
                    recovery.notify()
                    ep.abandon()
                except RollbackRequested:
                    ep.abandon()
                outcome = recovery.vote(fault, ep.publication_state())
                if not outcome.failed:
                    break
                ep.resync(outcome.states)
                outcomes.append((it, outcome))
        for it in range(NUM_ITERATIONS):
            for layer, (got, want) in enumerate(zip(outputs[it], group.oracle(it))):
                assert np.array_equal(got, want), f"iteration {it} layer {layer} differs"
        assert fired_attempts(raised) == [(2, 0), (5, 0), (9, 0), (9, 1), (13, 0), (17, 0)]
        assert recovery.epoch == len(outcomes) == 6
        assert [
            (it, [(f.die, f.op, f.event_id, f.code) for f in o.faults]) for it, o in outcomes
        ] == [
            (2, [(1, "dispatch", 20, 1)]),
            (5, [(0, "combine", 52, 4)]),
            (9, [(LAST, "dispatch", 91, 1)]),
            (9, [(LAST, "dispatch", 91, 1)]),
            (13, [(0, "dispatch", 131, 1), (1, "dispatch", 131, 1)]),
            (17, [(1, "combine", 171, 1)]),
        ]
    finally:
        group.close()


@pytest.mark.mpi(min_size=2)
def test_a_die_stuck_in_a_wait_learns_of_the_fault_promptly(recovery):
    group = EpGroup()
    group.ep.set_recovery(RecoveryHooks(interrupt=recovery.interrupt))
    latency = None
    try:

        def slow_fault(op, event):  # everyone else is deep in the dispatch wait by now
            time.sleep(0.5)
            raise InjectedFault(comm.rank, op, event, 3)

        if comm.rank == LAST:
            group.ep.set_recovery(
                RecoveryHooks(interrupt=recovery.interrupt, fault_hook=slow_fault)
            )
        fault, notified_at, caught_at = None, None, None
        try:
            group.iteration(0)
        except InjectedFault as exc:
            fault, notified_at = exc, time.monotonic()  # CLOCK_MONOTONIC: one clock per node
            recovery.notify()
        except RollbackRequested:
            caught_at = time.monotonic()
        group.ep.abandon()
        outcome = recovery.vote(fault, group.ep.publication_state())
        assert outcome.failed and [f.die for f in outcome.faults] == [LAST]
        group.ep.resync(outcome.states)
        group.ep.set_recovery(RecoveryHooks(interrupt=recovery.interrupt))
        assert all(np.array_equal(a, b) for a, b in zip(group.iteration(0), group.oracle(0)))
        times = comm.allgather((notified_at, caught_at))
        latency = max(c for _, c in times if c is not None) - times[LAST][0]
        assert latency < 5.0 < POLL_TIMEOUT_S, (
            f"a waiting die learnt of the fault {latency:.2f} s after the notify"
        )
    finally:
        group.close()


@pytest.mark.mpi(min_size=2)
def test_a_persistent_fault_ends_every_die_with_a_named_error(recovery):
    cfg = FaultsConfig(
        table=[dict(die=LAST, op="combine", layer=1, iteration=2, times=100)], max_retries=2
    )
    group = EpGroup()
    plan = FaultPlan(cfg, comm.rank, EP_EVENTS)
    group.ep.set_recovery(RecoveryHooks(interrupt=recovery.interrupt, fault_hook=plan.check))
    started = time.monotonic()
    try:

        def attempt_of(it):
            def attempt(k):
                plan.begin(iteration=it, attempt=k)
                return group.iteration(it)

            return attempt

        for it in range(2):
            recovery.run(
                attempt_of(it), [group.ep], max_retries=cfg.max_retries, what=f"iteration {it}"
            )
        with pytest.raises(
            RetriesExhausted,
            match=rf"die rank {comm.rank}: iteration 2 failed 3 "
            rf"attempts \(max_retries 2\); the last: die "
            rf"{LAST} combine event 21 code 1$",
        ):
            recovery.run(attempt_of(2), [group.ep], max_retries=cfg.max_retries, what="iteration 2")
        assert recovery.epoch == 3
        assert time.monotonic() - started < 20
    finally:
        group.close()


@pytest.mark.mpi(min_size=2)
def test_random_faults_replay_with_the_same_seed(recovery):
    # About one fault in three attempts whatever the rank count; max_retries is generous.
    cfg = FaultsConfig(rate=0.06 / comm.size, ops=["dispatch", "combine"], seed=11, max_retries=6)
    group = EpGroup()
    try:
        runs = []
        for _ in range(2):
            plan, outcomes = FaultPlan(cfg, comm.rank, EP_EVENTS), []
            group.ep.set_recovery(
                RecoveryHooks(interrupt=recovery.interrupt, fault_hook=plan.check)
            )
            for it in range(10):

                def attempt(k):
                    plan.begin(iteration=it, attempt=k)
                    return group.iteration(it)

                ys = recovery.run(
                    attempt,
                    [group.ep],
                    max_retries=cfg.max_retries,
                    what=f"iteration {it}",
                    on_rollback=lambda o: outcomes.append((it, o.faults)),
                )
                assert all(np.array_equal(a, b) for a, b in zip(ys, group.oracle(it)))
            runs.append(outcomes)
        assert runs[0] == runs[1], "the same seed injected other faults"
        assert len(runs[0]) >= 2, f"only {len(runs[0])} rollbacks: the test shows little"
    finally:
        group.close()


# -- (b) A2E / E2A with the expert dies' persistent loop -------------------------------------------
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
        self.layout = AfdLayout(
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


# -- (c) point-to-point ---------------------------------------------------------------------------
SLOTS, SLOT = 4, 64
P2P_TABLE = [
    dict(die=0, op="p2p_send", layer=0, iteration=1),  # mid-message (5 fills)
    dict(die=1, op="p2p_recv", layer=0, iteration=3),
    dict(die=LAST, op="p2p_send", layer=0, iteration=5, times=2),
    dict(die=0, op="p2p_recv", layer=0, iteration=6),
    dict(die=1, op="p2p_send", layer=0, iteration=6),
]


@pytest.mark.mpi(min_size=2)
def test_send_recv_pairs_restart_cleanly_after_faults_on_either_side(recovery):
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, all_pairs(range(comm.size)))
    mem = DieMemory(comm, layout.window_bytes(comm.rank))
    p2p = P2P(mem, layout, timeout_s=POLL_TIMEOUT_S)
    plan = FaultPlan(
        FaultsConfig(table=P2P_TABLE), comm.rank, LayerEvents(events_per_iteration=1)
    )  # one layer: 0
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    raised = []
    p2p.set_recovery(RecoveryHooks(interrupt=recovery.interrupt, fault_hook=counting(plan, raised)))
    try:
        for it in range(8):
            nbytes = int(2.5 * SLOTS * SLOT) if it % 2 else 40 + it

            def attempt(k):
                plan.begin(iteration=it, attempt=k)
                out = np.full(nbytes + 8, 0xA5, np.uint8)
                send = p2p.isend(tagged_payload(comm.rank, right, it, nbytes), right, it)
                recv = p2p.irecv(out[:nbytes], left, it)
                send.wait()
                recv.wait()
                return out

            out = recovery.run(attempt, [p2p], max_retries=2, what=f"iteration {it}")
            assert (out[:nbytes] == tagged_payload(left, comm.rank, it, nbytes)).all(), (
                f"iteration {it}: message from rank {left} differs"
            )
            assert (out[nbytes:] == 0xA5).all(), f"iteration {it}: overrun"
        assert fired_attempts(raised) == [(1, 0), (3, 0), (5, 0), (5, 1), (6, 0)]
        assert recovery.epoch == 5
    finally:
        comm.Barrier()
        mem.free()


def counting(plan: FaultPlan, raised: list):
    """`plan`'s fault hook, noting (iteration, attempt) in `raised` each time it injects one."""

    def counted(op, event):
        try:
            plan.check(op, event)
        except InjectedFault:
            raised.append((plan.iteration, plan.attempt))
            raise

    return counted
