"""FaultPlan: table rows fire exactly where and as often as declared; the random mode replays."""

from __future__ import annotations

import pytest

from xccl.errors import InjectedFault
from xccl.recovery.faults import OPS
from xds_mpi.afd.plan import AfdPlan
from xds_mpi.config.schema import FAULT_OPS, FaultsConfig
from xds_mpi.execution.faults import RANDOM_CODE, FaultPlan, LayerEvents

TABLE = [
    {"die": 1, "op": "dispatch", "layer": 2, "iteration": 5, "code": 7},
    {"die": 1, "op": "e2a", "layer": 0, "iteration": 5, "times": 3},
    {"die": 0, "op": "combine", "layer": 2, "iteration": 5},
]
EVENTS = LayerEvents(events_per_iteration=10)  # event id = 10 x iteration + layer


def fired_at(plan, *, iterations=8, layers=4, attempts=4):
    """Every (op, iteration, layer, attempt) -> code where the plan fires."""
    return {
        (op, it, layer, attempt): code
        for op in FAULT_OPS
        for it in range(iterations)
        for layer in range(layers)
        for attempt in range(attempts)
        if (code := plan.decide(op, iteration=it, layer=layer, attempt=attempt)) is not None
    }


def test_xccl_and_the_config_name_the_same_operations():
    assert OPS == FAULT_OPS


def test_table_rows_fire_on_their_die_op_layer_iteration_and_times_attempts():
    cfg = FaultsConfig(table=TABLE)
    assert fired_at(FaultPlan(cfg, 1, EVENTS)) == {
        ("dispatch", 5, 2, 0): 7,
        ("e2a", 5, 0, 0): 1,
        ("e2a", 5, 0, 1): 1,
        ("e2a", 5, 0, 2): 1,
    }
    assert fired_at(FaultPlan(cfg, 0, EVENTS)) == {("combine", 5, 2, 0): 1}
    assert fired_at(FaultPlan(cfg, 2, EVENTS)) == {}


def test_the_counter_counts_fired_decisions_by_op():
    plan = FaultPlan(FaultsConfig(table=TABLE), 1, EVENTS)
    fired_at(plan)
    assert plan.fired == {"dispatch": 1, "e2a": 3}
    assert plan.num_fired == 4


def test_random_mode_replays_and_roughly_honours_the_rate():
    cfg = FaultsConfig(rate=0.1, seed=3)
    first = fired_at(FaultPlan(cfg, 2, EVENTS), iterations=40)
    again = fired_at(FaultPlan(cfg, 2, EVENTS), iterations=40)
    assert first == again and set(first.values()) == {RANDOM_CODE}
    draws = len(FAULT_OPS) * 40 * 4 * 4
    assert 0.07 < len(first) / draws < 0.13, f"{len(first)} of {draws} fired"
    other_seed = fired_at(FaultPlan(FaultsConfig(rate=0.1, seed=4), 2, EVENTS), iterations=40)
    other_die = fired_at(FaultPlan(cfg, 3, EVENTS), iterations=40)
    assert first != other_seed and first != other_die


def test_random_attempts_and_calls_draw_independently():
    plan = FaultPlan(FaultsConfig(rate=0.5, seed=1), 0, EVENTS)

    def draws(**where):
        return [plan.decide("a2e", iteration=i, layer=1, **where) is not None for i in range(400)]

    attempt0, attempt1 = draws(attempt=0), draws(attempt=1)
    call1 = draws(attempt=0, call=1)
    for other in (attempt1, call1):
        agree = sum(a == b for a, b in zip(attempt0, other)) / len(attempt0)
        assert 0.4 < agree < 0.6, f"attempts/calls agree on {agree:.0%} of draws"


def test_ops_filter_the_random_mode_only():
    cfg = FaultsConfig(
        rate=0.5, ops=["dispatch"], table=[{"die": 0, "op": "p2p_send", "layer": 0, "iteration": 0}]
    )
    fired = fired_at(FaultPlan(cfg, 0, EVENTS))
    assert {op for op, *_ in fired} == {"dispatch", "p2p_send"}
    assert [k for k in fired if k[0] == "p2p_send"] == [("p2p_send", 0, 0, 0)]


def test_no_faults_configured_never_fires():
    assert fired_at(FaultPlan(FaultsConfig(), 0, EVENTS)) == {}


def test_an_unknown_operation_is_refused():
    with pytest.raises(ValueError, match="unknown operation 'alltoall'"):
        FaultPlan(FaultsConfig(), 0, EVENTS).decide("alltoall", iteration=0, layer=0, attempt=0)


def test_the_hook_numbers_calls_per_layer_and_raises_an_injected_fault():
    plan = FaultPlan(
        FaultsConfig(table=[{"die": 4, "op": "a2e", "layer": 1, "iteration": 2, "code": 9}]),
        4,
        EVENTS,
    )
    plan.begin(iteration=2, attempt=0)
    plan.check("a2e", 20)  # layer 0: nothing
    with pytest.raises(InjectedFault) as err:
        plan.check("a2e", 21)
    assert (err.value.die, err.value.op, err.value.event_id, err.value.code) == (4, "a2e", 21, 9)
    assert str(err.value) == "die rank 4: injected fault (code 9) in a2e event 21"
    plan.begin(iteration=2, attempt=1)
    plan.check("a2e", 21)  # cleared on the re-execution
    seen = []
    random_plan = FaultPlan(FaultsConfig(rate=0.5), 0, EVENTS)
    random_plan.decide = lambda op, **where: seen.append((where["layer"], where["call"]))
    random_plan.begin(iteration=0, attempt=0)
    for event in (3, 3, 13, 4):
        random_plan.check("e2a", event)
    random_plan.check("a2e", 3)
    random_plan.begin(iteration=0, attempt=1)  # an attempt numbers its calls afresh
    random_plan.check("e2a", 3)
    assert seen == [(3, 0), (3, 1), (3, 2), (4, 0), (3, 0), (3, 0)]


def test_the_event_maps_name_the_layer_of_every_event():
    events = LayerEvents(events_per_iteration=6)  # 4 layers + MTP depth 2
    assert [
        events.layer_of_event(events.event_id(it, layer)) for it in (0, 7) for layer in range(6)
    ] == list(range(6)) * 2
    plan = AfdPlan(moe_layers=(1, 2, 4, 5), num_domains=2, num_microbatches=3)
    for it in (0, 3):
        calls = plan.iteration((0, 1), it)
        assert [plan.layer_of_event(c.call.event_id) for c in calls] == [c.layer_idx for c in calls]


def test_an_unknown_operation_in_the_hook_is_refused():
    plan = FaultPlan(FaultsConfig(), 0, EVENTS)
    plan.begin(iteration=0, attempt=0)
    with pytest.raises(ValueError, match="die 0: unknown operation 'alltoall'"):
        plan.check("alltoall", 0)
