"""A die process imports numpy and mpi4py, never torch (docs/design.md: torch costs 2.1 s and
~190 MiB per process): the role modules at import, and every rank of a served run. So torch is an
extra (`train`, and the test extra for the oracle tests), and the commands that need it say which
extra to install when it is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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


def test_torch_is_an_extra_and_the_test_extra_has_it():
    """`pip install -e .` brings no torch; `train` does, and `test` (the README's install line)
    repeats train's requirement for the oracle tests."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def torch_lines(requirements):
        return [r for r in requirements if r.split(">")[0].split("<")[0].strip() == "torch"]

    assert torch_lines(project["dependencies"]) == []
    assert len(torch_lines(extras["train"])) == 1
    assert torch_lines(extras["test"]) == torch_lines(extras["train"])


@pytest.mark.parametrize("command", [["train-tiny", "--steps", "1"], ["stats"]])
def test_a_command_that_needs_torch_names_the_extra_when_torch_is_missing(command):
    """torch hidden from a fresh interpreter (None in sys.modules: `import torch` raises
    ModuleNotFoundError, as without the package): one line naming the extra, exit 2, no
    traceback."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from launch.cli.main import main\n"
        f"sys.exit(main({command!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith(
        f"xds-mpi: error: `xds-mpi {command[0]}` needs torch"
    )
    assert "pip install -e '.[train]'" in line and "pip install 'xds-mpi[train]'" in line
