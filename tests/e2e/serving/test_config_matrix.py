"""Every config the validator accepts serves token-exact; every one it refuses is refused before
launch, with a reason that names the key.

The axes are in tests/config_matrix.py. By default the accepted combinations run as a pairwise
cover (every pair of values of two axes that some accepted combination holds is served at least
once); `pytest --config-matrix=full` serves every accepted combination.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache

import config_matrix as m
from harness import REPO_ROOT
from test_serving import XDS_MPI, check_line

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan

BASE_WORKLOAD = (0,) * len(m.WORKLOAD_AXES)
NAMES_A_KEY = re.compile(
    r"\b(deployment|model|scheduler|workload|xccl|faults|hardware|run)"
    r"(\.\w+|:)"
)


def refusal(combo: tuple[int, ...]) -> str:
    """The validator's reason to refuse the combination, "" if it accepts it."""
    kind, sets = m.overrides(combo)
    try:
        DeploymentPlan.build(load_config(m.config_path(kind), sets))
    except ConfigError as exc:
        return str(exc)
    return ""


@cache
def deployments() -> dict[tuple[int, ...], str]:
    """Every combination of the deployment axes (base workload) -> its refusal reason or ""."""
    return {c: refusal(c + BASE_WORKLOAD) for c in m.product(m.DEPLOYMENT_AXES)}


@cache
def accepted(scope: str) -> list[tuple[int, ...]]:
    workloads = m.product(m.WORKLOAD_AXES)
    every = [d + w for d, reason in deployments().items() if not reason for w in workloads]
    return every if scope == "full" else m.pairwise(every)


def reason_kind(reason: str) -> str:
    """A refusal without its numbers: one CLI test per kind of reason."""
    return re.sub(r"[-\d]+", "N", reason.split(": ", 1)[-1])[:60]


@cache
def refused_examples() -> dict[str, tuple[int, ...]]:
    examples = {}
    for combo, reason in deployments().items():
        if reason:
            examples.setdefault(reason_kind(reason), combo + BASE_WORKLOAD)
    return examples


def pytest_generate_tests(metafunc):
    if "accepted_combo" in metafunc.fixturenames:
        combos = accepted(metafunc.config.getoption("--config-matrix"))
        metafunc.parametrize("accepted_combo", combos, ids=[m.label(c) for c in combos])
    if "refused_combo" in metafunc.fixturenames:
        examples = refused_examples()
        metafunc.parametrize(
            "refused_combo", list(examples.values()), ids=[m.label(c) for c in examples.values()]
        )


def run(combo: tuple[int, ...], tmp_path) -> subprocess.CompletedProcess:
    kind, sets = m.overrides(combo)
    args = [
        str(XDS_MPI),
        "run",
        kind,
        "--check",
        "--set",
        f"run.output_dir={tmp_path}",
        "--set",
        "run.timeout_s=240",
    ]
    for line in sets:
        args += ["--set", line]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)


def test_every_refusal_names_the_key_and_some_shapes_are_accepted():
    verdicts = deployments()
    refused = {c: r for c, r in verdicts.items() if r}
    assert 0 < len(refused) < len(verdicts)
    for combo, reason in refused.items():
        assert NAMES_A_KEY.search(reason), f"{m.label(combo)}: {reason}"


def test_the_workload_axes_never_decide_acceptance():
    # Why the matrix validates the deployment axes once: the workload axes only change requests.
    some = [c for c in list(deployments())[::97]]
    for combo in some:
        verdicts = {bool(refusal(combo + w)) for w in m.product(m.WORKLOAD_AXES)}
        assert len(verdicts) == 1, m.label(combo + BASE_WORKLOAD)


def test_an_accepted_config_serves_token_exact(accepted_combo, tmp_path):
    result = run(accepted_combo, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.fullmatch(r"check: 4 requests, \d+ tokens, 0 mismatches", check_line(result))


def test_a_refused_config_is_refused_before_launch(refused_combo, tmp_path):
    result = run(refused_combo, tmp_path)
    assert result.returncode != 0
    assert "launching" not in result.stdout
    assert refusal(refused_combo).split(": ", 1)[-1] in result.stderr, result.stderr[-2000:]
