"""Dispatch/combine iterations recover from injected faults (tests/mpi/faults_common.py)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from faults_common import (
    EXPERTS_PER_DIE,
    HIDDEN,
    LAST,
    MAX_TOKENS,
    POLL_TIMEOUT_S,
    TOP_K,
    batch,
    comm,
    expert_fn,
    fired_attempts,
)
from faults_common import recovery as recovery  # the fixture; the alias re-exports it to pytest

from xccl.ep.buffer import EpBuffer
from xccl.errors import InjectedFault, RetriesExhausted, RollbackRequested
from xccl.gmem import DieMemory
from xccl.moe_layout import EpLayout
from xccl.recovery.faults import RecoveryHooks
from xccl.reference import combine_reference
from xds_mpi.config.schema import FaultsConfig
from xds_mpi.execution.faults import FaultPlan, LayerEvents

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


def attempt_until_agreed(group, plan, recovery, it, raised, outcomes):
    """Iteration `it` attempted until every die votes it done -> its outputs. The coordinator's
    steps spelled out (xccl/recovery/rollback.py `Recovery.run` does the same): attempt, notify on a
    fault, abandon, vote, resync. Notes (it, attempt) of this die's faults in `raised` and
    (it, outcome) of each rollback in `outcomes`."""
    ep, ys = group.ep, None
    for attempt in itertools.count():
        assert attempt <= 2, f"iteration {it} still failing at attempt {attempt}"
        plan.begin(iteration=it, attempt=attempt)
        fault = None
        try:
            ys = group.iteration(it)
        except InjectedFault as exc:
            fault = exc
            raised.append((it, attempt))
            recovery.notify()
            ep.abandon()
        except RollbackRequested:
            ep.abandon()
        outcome = recovery.vote(fault, ep.publication_state())
        if not outcome.failed:
            return ys
        ep.resync(outcome.states)
        outcomes.append((it, outcome))


@pytest.mark.mpi(min_size=2)
def test_dispatch_combine_iterations_recover_from_injected_faults(recovery):
    group = EpGroup()
    ep, plan = group.ep, FaultPlan(FaultsConfig(table=EP_TABLE), comm.rank, EP_EVENTS)
    ep.set_recovery(RecoveryHooks(interrupt=recovery.interrupt, fault_hook=plan.check))
    outputs, raised, outcomes = {}, [], []
    try:
        for it in range(NUM_ITERATIONS):
            outputs[it] = attempt_until_agreed(group, plan, recovery, it, raised, outcomes)
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
