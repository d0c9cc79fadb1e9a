"""What a die process runs before it is built costs start-up CPU in every rank (issue 33: launch to
ready <= 0.5 CPU-s per die; docs/scale.md). Modules no die uses stay out of it, so that an import
put back at module level, or a rank that generates the workload again, shows here."""

from __future__ import annotations

import subprocess
import sys

from harness import REPO_ROOT

DIE_MODULES = (
    "ranks.colocated.die",
    "ranks.afd.attention",
    "ranks.afd.expert",
    "ranks.pd.prefill",
    "ranks.pd.decode",
)
# What the die constructors import when they run (their lazy imports).
BUILT_BY_DIES = (
    "xccl.ep.buffer",
    "xccl.vclock",
    "xds_mpi.engine.executor",
    "xds_mpi.engine.attention_executor",
    "xds_mpi.engine.slots",
    "xds_mpi.model.weights",
)
# hashlib: OpenSSL's load, ~5 ms (the config digest is a CRC-32; the EMS namespace imports it
# where EMS runs). numpy.random: ~10-15 ms (only the TE-shell reads the workload; a die draws
# random numbers only for random weights, sampling temperature or a fault rate). argparse: ~9 ms
# with its parser (launch/rank.py parses its two kinds of argument by hand). A colocated die's
# EPLB side and its count records: ~5 ms, imported only with eplb.enabled
# (ranks/colocated/eplb_hooks.py).
KEPT_OUT = (
    "argparse",
    "hashlib",
    "numpy.random",
    "ranks.colocated.eplb",
    "xds_mpi.eplb.records",
)


def test_a_die_imports_plans_and_greets_without_what_it_does_not_use():
    """Every die role's modules, a rank's plan (launch/rank.py: launcher_checks=False) of each
    deployment kind, and the handshake's config digest."""
    code = (
        "import logging, sys\n"
        "from mpi4py import MPI\n"
        "import launch.rank\n"
        f"for name in {DIE_MODULES + BUILT_BY_DIES!r}: __import__(name)\n"
        "from ranks.core.context import RankContext\n"
        "from xds_mpi.config.schema import load_config\n"
        "from xds_mpi.plan.deployment import DeploymentPlan\n"
        "for name in ('colocated', 'afd', 'pd'):\n"
        "    cfg = load_config(f'configs/{name}.yaml')\n"
        "    plan = DeploymentPlan.build(cfg, launcher_checks=False)\n"
        "    ctx = RankContext(plan=plan, comm=MPI.COMM_SELF, log=logging.getLogger(), "
        "node_leader=0)\n"
        "    assert len(ctx.config_digest()) == 8\n"
        f"print(sorted(m for m in {KEPT_OUT!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
