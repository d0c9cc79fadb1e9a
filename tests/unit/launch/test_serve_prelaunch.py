"""`xds-mpi serve` warns before launch when one lost die would stop the server: heartbeats on,
experts held by one die only (health.replicas=none) and health.on_expert_lost=stop; the
warning names the keys that keep it serving, and ring replicas (or a restart policy) silence
it."""

from __future__ import annotations

import argparse

import pytest

import launch.serve.command as command
from launch.serve.prelaunch import expert_loss_warning, experts_alone
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import load_config
from xds_mpi.plan.deployment import DeploymentPlan


def plan(config: str, *sets: str) -> DeploymentPlan:
    return DeploymentPlan.build(load_config(resolve_config(config), [*sets]), None)


def test_the_default_colocated_server_is_told_what_a_lost_die_does():
    warning = expert_loss_warning(plan("colocated"))
    assert "health.replicas=none; e.g. die rank 1: routed experts 0-3" in warning
    assert "health.on_expert_lost=stop: one lost die stops the server" in warning
    assert warning.endswith(
        "--set health.replicas=ring --set deployment.redundant_slots_per_die=4 (docs/failures.md)"
    )
    # the placement it read: 16 experts, 4 on each of the 4 dies, none on two
    assert experts_alone(plan("colocated")) == {
        rank: tuple(range(4 * (rank - 1), 4 * rank)) for rank in (1, 2, 3, 4)
    }


@pytest.mark.parametrize(
    "sets",
    [
        ("health.replicas=ring", "deployment.redundant_slots_per_die=4"),
        ("health.on_expert_lost=restart",),
        ("health.enabled=false",),
    ],
)
def test_a_server_that_survives_a_lost_die_is_not_warned(sets):
    assert expert_loss_warning(plan("colocated", *sets)) == ""


def test_afd_names_its_expert_dies():
    warning = expert_loss_warning(plan("afd"))
    assert "3 dies hold experts no other die has" in warning
    assert "deployment.redundant_slots_per_die=6" in warning


def test_serve_prints_it_before_launch(monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(command, "compile_rank_code", lambda: None)
    monkeypatch.setattr(command, "unpack_weights", lambda *a: None)
    monkeypatch.setattr(command, "_run", lambda argv, env, *rest: launched.append(env) or 0)
    args = argparse.Namespace(
        config="colocated", set=[], np=None, host=None, port=0, model=None, max_queued=None,
        on_shutdown=None, check=False, memory_check=False, mpiexec=None, api_key=None,
        trace_max_events=1234, max_records=567, max_iterations=89,
    )  # fmt: skip
    assert command.cmd_serve(args) == 0
    err = capsys.readouterr().err
    assert err.startswith("xds-mpi: warning: heartbeats watch the dies (health.enabled)")
    assert launched[0]["XDS_TRACE_MAX_EVENTS"] == "1234"  # the ranks' trace cap
    assert launched[0]["XDS_SERVE_MAX_RECORDS"] == "567"  # the TE-shell's record cap
    assert launched[0]["XDS_SERVE_MAX_ITERATIONS"] == "89"  # each die's timings cap
