"""A die process imports numpy and mpi4py, never torch (DESIGN.md §7: torch costs 2.1 s and
~190 MiB per process): the role modules at import, and every rank of a served run."""

from __future__ import annotations

import os
import subprocess
import sys

from harness import REPO_ROOT, fresh_python

ROLE_MODULES = (
    "ranks.colocated.die",
    "ranks.afd.attention",
    "ranks.afd.expert",
    "ranks.pd.prefill",
    "ranks.shell.te_shell",
)


def test_role_modules_and_the_model_import_no_torch():
    code = (
        "import sys\n"
        f"for name in {ROLE_MODULES!r}: __import__(name)\n"
        "from xds_mpi.execution import executor\n"
        "from xds_mpi.afd import attention_executor\n"
        "from xds_mpi.pd import kv\n"
        "from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator\n"
        "from xds_mpi.model.shapes import compute_shape\n"
        "from xds_mpi.model.weights import build_model\n"
        "ReferenceGenerator(build_model(compute_shape()), GenerateOptions(max_new_tokens=2,"
        " mtp_depth=1)).generate([[256, 1, 2]])\n"
        "print('torch' in sys.modules)\n"
    )
    assert fresh_python(code) == "False"


def test_a_served_run_checks_out_with_torch_unimportable(tmp_path):
    """Every rank (and the check in the launching process) on a path where `import torch`
    fails: the run must still serve every request and match the reference."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('a die process imported torch')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "run", "--check", "--set", "scheduler.mtp_depth=1"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 mismatches" in out.stdout + out.stderr
