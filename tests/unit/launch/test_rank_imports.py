"""What a die process runs before it is built costs start-up CPU in every rank (issue 33: launch to
ready <= 0.5 CPU-s per die; docs/scale.md). Modules no die uses stay out of it, so that an import
put back at module level, or a rank that generates the workload again, shows here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import REPO_ROOT

from xds_mpi.config.schema import load_config
from xds_mpi.plan.resolved import write_resolved

# What the die constructors import when they run (their lazy imports).
BUILT_BY_DIES = (
    "xccl.ep.buffer",
    "xccl.vclock",
    "xds_mpi.execution.executor",
    "xds_mpi.afd.attention_executor",
    "xds_mpi.execution.slots",
    "xds_mpi.model.weights",
    "xds_mpi.projection.cost",
)
# Out of every die: hashlib, OpenSSL's load, ~5 ms (the config digest is a CRC-32; the EMS
# namespace imports it where EMS runs); numpy.random, ~10-15 ms (only the TE-shell reads the
# workload; a die draws random numbers only for random weights, sampling temperature or a fault
# rate); argparse, ~9 ms with its parser (launch/job/rank.py parses its two arguments by hand);
# statistics, ~5 ms with fractions and decimal (the pricer's normal quantile is
# xds_mpi/projection/normal.py; only the TE-shell's start-up line takes a median).
NEVER = ("argparse", "hashlib", "numpy.random", "statistics")
# Out of a colocated die without EPLB or PD: its EPLB side and count records, ~5 ms
# (ranks/colocated/eplb_hooks.py); a prefill TP group's layout and the KV links' check, ~3 ms
# (xds_mpi/plan/pd.py imports them where PD runs).
ONLY_WITH_EPLB_OR_PD = (
    "ranks.colocated.eplb",
    "xccl.tp_gather",
    "xds_mpi.eplb.records",
    "xds_mpi.plan.kv_link",
)


def imported(roles: tuple[str, ...], configs: tuple[str, ...]) -> list[str]:
    """Which of NEVER + ONLY_WITH_EPLB_OR_PD a process holds after importing what a rank
    imports for `roles`, building each config's plan as a rank does (launch/job/rank.py:
    launcher_checks=False) and the handshake's config digest."""
    code = (
        "import json, logging, sys\n"
        "from mpi4py import MPI\n"
        "import launch.job.rank\n"
        f"for name in {roles + BUILT_BY_DIES!r}: __import__(name)\n"
        "from ranks.core.context import RankContext\n"
        "from xds_mpi.config.schema import load_config\n"
        "from xds_mpi.plan.deployment import DeploymentPlan\n"
        f"for name in {configs!r}:\n"
        "    plan = DeploymentPlan.build(load_config(f'configs/{name}.yaml'), "
        "launcher_checks=False)\n"
        "    ctx = RankContext(plan=plan, comm=MPI.COMM_SELF, log=logging.getLogger(), "
        "node_leader=0)\n"
        "    assert len(ctx.config_digest()) == 8\n"
        f"print(json.dumps(sorted(m for m in {NEVER + ONLY_WITH_EPLB_OR_PD!r} "
        "if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    return json.loads(out.stdout)


def test_a_colocated_die_without_eplb_or_pd_imports_none_of_them():
    assert imported(("ranks.colocated.die",), ("colocated",)) == []


@pytest.mark.parametrize(
    "roles,config",
    [
        (("ranks.afd.attention", "ranks.afd.expert"), "afd"),
        (("ranks.pd.prefill", "ranks.pd.decode"), "pd"),
    ],
)
def test_no_die_imports_what_no_die_uses(roles, config):
    assert not set(imported(roles, (config,))) & set(NEVER)


def test_a_rank_given_the_resolved_file_reads_its_preset_and_profiles_without_pyyaml(tmp_path):
    """PyYAML, ~25 ms: a rank the launcher handed its config resolved into JSON
    (xds_mpi/plan/resolved.py) reads it, the cost preset and the hardware profiles (here a PD
    rank's, with a 910B prefill profile) without it, and gets the YAML's values."""
    path, overrides = REPO_ROOT / "configs" / "pd.yaml", ["pd.prefill_profile=ascend910b"]
    cfg = load_config(path, overrides)
    resolved = write_resolved(tmp_path, path, overrides, cfg)
    code = (
        "import dataclasses, json, sys\n"
        "import launch.job.rank, ranks.colocated.die, ranks.afd.attention, ranks.afd.expert\n"
        "import ranks.pd.prefill, ranks.pd.decode\n"
        f"for name in {BUILT_BY_DIES!r}: __import__(name)\n"
        "from xds_mpi.plan.resolved import read_resolved\n"
        "from xds_mpi.model.shapes import cost_shape\n"
        "from xds_mpi.config.hardware import load_profile\n"
        f"cfg = read_resolved({str(resolved)!r}, {str(path)!r}, {overrides!r})\n"
        "values = [dataclasses.asdict(cost_shape()), load_profile(cfg.hardware.profile), "
        "load_profile(cfg.pd.prefill_profile)]\n"
        "print(json.dumps({'yaml': 'yaml' in sys.modules, 'values': values}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    got = json.loads(out.stdout)
    from dataclasses import asdict

    from xds_mpi.config.hardware import load_profile
    from xds_mpi.model.shapes import cost_shape

    assert got["yaml"] is False
    expected = [asdict(cost_shape()), load_profile("ascend910c"), load_profile("ascend910b")]
    assert json.loads(json.dumps(expected)) == got["values"]
