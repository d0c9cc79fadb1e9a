"""EPLB in a run: the `eplb` section's refusals before launch, and a colocated run with MTP that
swaps replicas several times while decoding and still equals the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.report import plots as report_plots
from xds_mpi.report.data import load_run

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def build(**sections):
    return DeploymentPlan.build(config_from_dict(sections))


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"eplb": {"enabled": True}},
            "deployment.redundant_slots_per_die is 0 on 4 routed-expert dies",
        ),
        (
            {
                "deployment": {"redundant_slots_per_die": 1},
                "eplb": {"enabled": True, "redundancy_budget": 5},
            },
            "eplb.redundancy_budget(5) > free redundant slots per MoE layer: 4 routed-expert "
            "dies x deployment.redundant_slots_per_die(1) = 4",
        ),
        ({"eplb": {"interval": 0}}, "eplb.interval must be > 0, got 0"),
        ({"eplb": {"slices": -1}}, "eplb.slices must be > 0, got -1"),
        (
            {"eplb": {"policy": "random"}},
            "eplb.policy must be one of 'flowserve', 'deepseek', 'none'",
        ),
        (
            {
                "deployment": {
                    "kind": "afd",
                    "num_expert_dies": 4,
                    "redundant_slots_per_die": 1,
                },
                "eplb": {"enabled": True},
            },
            "eplb.enabled needs a colocated deployment, got deployment.kind='afd'",
        ),
    ],
)
def test_eplb_config_that_cannot_run_is_refused_with_the_numbers(sections, message):
    with pytest.raises(ConfigError) as info:
        build(**sections)
    assert message in str(info.value)


def test_budget_within_the_free_slots_builds():
    plan = build(
        deployment={"redundant_slots_per_die": 2}, eplb={"enabled": True, "redundancy_budget": 8}
    )
    assert plan.cfg.eplb.redundancy_budget == 8


def test_replicas_swap_while_decoding_and_tokens_equal_the_reference(tmp_path):
    """4 dies, one redundant slot each, MTP depth 1; a rebalance after every 2-iteration slice:
    several swaps, iterations decoded while weights loaded, 0 mismatches."""
    overrides = {
        "deployment.redundant_slots_per_die": 1,
        "scheduler.mtp_depth": 1,
        "workload.num_requests": 8,
        "workload.output_len": 24,
        "workload.prompt_len": 12,
        "workload.ignore_eos": "true",
        "eplb.enabled": "true",
        "eplb.interval": 2,
        "eplb.slices": 1,
        "run.output_dir": str(tmp_path),
        "run.name": "eplb",
    }
    args = [a for key, value in overrides.items() for a in ("--set", f"{key}={value}")]
    result = subprocess.run(
        [str(XDS_MPI), "run", "colocated", "--check", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 mismatches" in result.stdout
    with h5py.File(tmp_path / "eplb.h5", "r") as f:
        eplb = f["eplb"]
        assert eplb.attrs["num_reconfigs"] >= 2
        assert eplb.attrs["num_loading_iterations"] > 0
        assert eplb["slice_counts"].shape[1:] == (3 + 1, 16)  # 3 MoE layers + MTP, 16 experts
        assert f["summary"].attrs["check_mismatches"] == 0
        num_reconfigs = int(eplb.attrs["num_reconfigs"])
        expected_loads = steady_loads(eplb)
    # The trace shows each die's swap phases: one enable per reconfiguration on each of 4 dies,
    # and the loads on the 910C clock like on the wall clock.
    events = json.loads((tmp_path / "eplb.trace.json").read_text())["traceEvents"]
    phases = Counter(e["args"]["phase"] for e in events if e.get("name") == "eplb")
    assert phases["enable"] == 2 * 4 * num_reconfigs, phases  # two clocks x 4 dies
    # A placement decided near the end may be prefetched but never enabled (decoding ended):
    # at most one reconfiguration in flight, on every die and both clocks.
    in_flight = phases["prefetch + disable"] - phases["enable"]
    assert phases["load"] > 0 and in_flight in (0, 2 * 4), phases
    # The report draws the measured die load before and after ([MoE layers, dies] each), from
    # the steady slices recomputed here. Which versions have one varies from run to run: with
    # 2-iteration slices and a decision after each, the next placement may land (and start
    # loading) in the first slice after a swap, before that slice is steady.
    run = load_run(tmp_path / "eplb.h5")
    assert run.eplb_loads.keys() == expected_loads.keys()
    for name, rows in expected_loads.items():
        assert rows.shape == (4, 4) and rows.sum() > 0
        np.testing.assert_allclose(run.eplb_loads[name], rows, err_msg=name)
    assert report_plots.eplb(run, tmp_path / "eplb.png").stat().st_size > 0


def steady_loads(eplb) -> dict[str, np.ndarray]:
    """Routed rows per iteration [MoE layers, dies] of each placement version's steady slices
    (one version throughout, no weights loading, no prefill), and of versions 1+ pooled as
    "after", from the run file's `eplb` group."""
    start, end = eplb["slice_version_start"][()], eplb["slice_version_end"][()]
    is_steady = (start == end) & (eplb["slice_num_loading"][()] == 0)
    is_steady &= eplb["slice_num_prefill"][()] == 0
    rows, iterations = eplb["slice_die_rows"][()], eplb["slice_num_iterations"][()]

    def load(mask):
        return rows[mask].sum(axis=0) / iterations[mask].sum()

    loads = {f"v{v}": load(is_steady & (start == v)) for v in np.unique(start[is_steady])}
    if (is_steady & (start > 0)).any():
        loads["after"] = load(is_steady & (start > 0))
    return loads
