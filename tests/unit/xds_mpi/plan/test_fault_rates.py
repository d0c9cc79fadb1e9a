"""faults.rate in users' units (xds_mpi/plan/failures/rates.py): calls counted as the dies' call
plans make them, rates converted to the per-call chance the injector draws with, and a run more
likely than not to exhaust faults.max_retries refused with its numbers (the guide's lesson: 1 % per
call is hopeless at 8 dies)."""

from __future__ import annotations

import math

import pytest
from harness import REPO_ROOT

from xds_mpi.afd.plan import AfdPlan
from xds_mpi.config.schema import ConfigError, FaultsConfig, load_config
from xds_mpi.execution.fault_rates import projected_iteration_s, resolve
from xds_mpi.execution.faults import FaultPlan, LayerEvents
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.failures.rates import HOUR_S, count_calls, fault_risk, judge

PD_AFD = ["scheduler.mtp_depth=1"]  # the pd_afd run


def plan_of(name: str, overrides=()) -> DeploymentPlan:
    cfg = load_config(REPO_ROOT / "configs" / f"{name}.yaml", list(overrides))
    return DeploymentPlan.build(cfg, launcher_checks=False)


def independent_exhaust(per_call: dict, calls: dict, max_retries: int, iterations: int) -> float:
    """The run's chance to exhaust max_retries, from the definitions, not the module's steps."""
    ok = 1.0
    for die, n in calls.items():
        ok *= (1 - per_call[die]) ** n
    per_iteration = (1 - ok) ** (max_retries + 1)
    return 1 - (1 - per_iteration) ** iterations


@pytest.mark.parametrize(
    "name, overrides, calls",
    [
        ("eplb", [], [8] * 8),  # 3 MoE layers + 1 MTP depth, dispatch + combine, 8 dies
        ("colocated", [], [6] * 4),
        ("pd_afd", PD_AFD, [16, 16, 32, 32]),  # attention: own domain; expert: both domains
    ],
)
def test_calls_per_die_are_those_of_the_call_plan(name, overrides, calls):
    plan = plan_of(name, overrides)
    counted = count_calls(plan.cfg, plan.topo)
    assert list(counted.values()) == calls
    if plan.cfg.deployment.kind == "afd":  # the afd dies' own plan, every domain busy
        cfg = plan.cfg
        moe = cfg.model.num_layers - cfg.model.num_dense_layers + cfg.scheduler.mtp_depth
        afd = AfdPlan(
            moe_layers=tuple(range(moe)),
            num_domains=plan.topo.num_dp_domains,
            num_microbatches=cfg.deployment.num_microbatches,
        )
        expert_calls = len(afd.iteration(tuple(range(plan.topo.num_dp_domains))))
        attention_calls = len(afd.iteration((0,)))
        assert sorted(set(counted.values())) == [2 * attention_calls, 2 * expert_calls]


@pytest.mark.parametrize(
    "name, overrides, share",
    [("eplb", [], "47.4% of attempts fail"), ("pd_afd", PD_AFD, "61.9% of attempts fail")],
)
def test_one_percent_per_call_is_refused_with_the_numbers(name, overrides, share):
    with pytest.raises(ConfigError, match=r"faults\.rate\(0\.01 per call\)") as refused:
        plan_of(name, [*overrides, "faults.rate=0.01"])
    message = str(refused.value)
    assert share in message and "faults.max_retries(3)" in message
    assert "more likely than not" in message


@pytest.mark.parametrize("name, overrides", [("eplb", []), ("pd_afd", PD_AFD)])
def test_one_percent_per_call_exhausts_as_the_definitions_say(name, overrides):
    plan = plan_of(name, overrides)
    cfg = load_config(REPO_ROOT / "configs" / f"{name}.yaml", [*overrides, "faults.rate=0.01"])
    risk = fault_risk(cfg, plan.topo)
    expected = independent_exhaust(risk.per_call, risk.calls_per_die, 3, risk.num_iterations)
    assert risk.exhaust_run == pytest.approx(expected, rel=1e-9)
    assert risk.exhaust_run > 0.5


@pytest.mark.parametrize("name, overrides", [("eplb", []), ("pd_afd", PD_AFD)])
def test_one_percent_per_iteration_is_accepted(name, overrides):
    plan = plan_of(name, [*overrides, "faults.rate=0.01", "faults.rate_unit=iteration"])
    risk = resolve(plan.cfg, plan.topo)
    for die, n in risk.calls_per_die.items():  # each die: 0.01 expected faults an iteration
        assert -n * math.log1p(-risk.per_call[die]) == pytest.approx(0.01)
    assert risk.exhaust_run < 0.01 and judge(risk) == ""


def test_a_die_hour_rate_goes_through_the_projected_iteration():
    plan = plan_of("eplb", ["faults.rate=200", "faults.rate_unit=die_hour"])
    risk = resolve(plan.cfg, plan.topo)
    iteration_s = projected_iteration_s(plan.cfg, plan.topo)
    assert risk.iteration_s == iteration_s > 0
    per_iteration = 200 * iteration_s / HOUR_S
    assert -8 * math.log1p(-risk.per_call[1]) == pytest.approx(per_iteration)


def test_a_die_hour_rate_too_high_is_refused_by_the_launcher_check():
    plan = plan_of("eplb", ["faults.rate=5000", "faults.rate_unit=die_hour"])
    with pytest.raises(ConfigError, match=r"faults\.rate\(5000 per die-hour, projected"):
        judge(resolve(plan.cfg, plan.topo))


def test_a_risky_rate_is_warned_about_with_its_numbers():
    plan = plan_of("eplb", ["faults.rate=0.03", "faults.rate_unit=iteration"])
    warning = judge(resolve(plan.cfg, plan.topo))
    assert warning.startswith("faults.rate(0.03 per iteration)") and "above 1%" in warning


def test_the_injector_draws_with_the_converted_chance():
    plan = plan_of("eplb", ["faults.rate=0.01", "faults.rate_unit=iteration"])
    risk = resolve(plan.cfg, plan.topo)
    fault_plan = FaultPlan(plan.cfg.faults, 3, LayerEvents(events_per_iteration=5))
    assert fault_plan.chance == risk.per_call[3] == pytest.approx(-math.expm1(-0.01 / 8))
    per_call = FaultPlan(FaultsConfig(rate=0.01), 3, LayerEvents(events_per_iteration=5))
    assert per_call.chance == 0.01
    with pytest.raises(ValueError, match=r"die 3: faults.rate_unit\(iteration\)"):
        FaultPlan(
            FaultsConfig(rate=0.01, rate_unit="iteration"), 3, LayerEvents(events_per_iteration=5)
        )


@pytest.mark.parametrize(
    "values, message",
    [
        ({"rate": 0.1, "rate_unit": "minute"}, r"faults.rate_unit must be one of"),
        ({"rate": 1.5, "rate_unit": "iteration"}, r"faults.rate must be in \[0, 1\)"),
        ({"rate": -1.0, "rate_unit": "die_hour"}, r"faults.rate must be >= 0"),
    ],
)
def test_rate_units_and_their_ranges_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        FaultsConfig(**values)
