"""The `xds-mpi` command: validate every shipped config, refuse bad ones in one line, launch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO_ROOT

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def xds_mpi(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(XDS_MPI), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)


def test_help_explains_the_commands():
    result = xds_mpi("--help")
    assert result.returncode == 0
    assert "validate" in result.stdout and "run" in result.stdout
    run_help = xds_mpi("run", "--help").stdout
    assert "--np" in run_help and "--set" in run_help and "--dry-run" in run_help


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_validates(config):
    result = xds_mpi("validate", str(config))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "rank  role" in result.stdout


def test_validate_without_config_uses_the_default_and_prints_the_rank_map():
    result = xds_mpi("validate")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("configs/colocated.yaml: valid")
    assert any(line.split()[:4] == ["1", "colocated", "0", "0/0/0"] for line in lines)


@pytest.mark.parametrize("args, message", [
    (["--set", "deployment.num_dies=3"], "unknown key 'num_dies' in section 'deployment'"),
    (["--np", "7"], "world size 7 != num_host_ranks(1) + colocated dies(4) = 5"),
    (["--set", "deployment.max_routed_experts_per_die=3"],
     "model.num_routed_experts(16) do not fit into 4 routed-expert dies x "
     "max_routed_experts_per_die(3) = 12 slots"),
    (["no-such-config"], "config 'no-such-config' is neither a file nor a name in configs/"),
])
def test_bad_input_is_one_line_with_the_numbers(args, message):
    result = xds_mpi("validate", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_unknown_key_in_a_file_names_key_and_section(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("xccl:\n  ring_slot: 4\n")
    result = xds_mpi("validate", str(path))
    assert result.returncode == 2
    assert "unknown key 'ring_slot' in section 'xccl'" in result.stderr


def test_run_dry_run_prints_the_mpiexec_line_with_mpi_environment():
    result = xds_mpi("run", "afd", "--dry-run", "--set", "run.timeout_s=77")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert " -n 8 " in line and "-m mpi4py -m launch.rank" in line
    assert "MPIEXEC_TIMEOUT=77" in line and "--set run.timeout_s=77" in line


def test_run_refuses_a_wrong_np_before_launching():
    result = xds_mpi("run", "--np", "3")
    assert result.returncode == 2 and "world size 3 != " in result.stderr
    assert "launching" not in result.stdout


@pytest.mark.parametrize("config, world_size", [("colocated", 5), ("afd", 8)])
def test_run_brings_up_every_rank(config, world_size):
    result = xds_mpi("run", config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all {world_size} ranks agree on the deployment" in result.stdout
    assert "[r0 host]" in result.stdout


def test_the_rank_entry_runs_under_plain_mpiexec():
    # What a user types by hand, without the launcher (the launcher adds only env and flags).
    from harness import run_mpi
    result = run_mpi(5, ["-m", "launch.rank", "configs/colocated.yaml"], timeout_s=60)
    assert result.returncode == 0, result.output
    assert "all 5 ranks agree" in result.output


def test_the_rank_entry_refuses_a_wrong_world_size_on_every_rank():
    from harness import run_mpi
    result = run_mpi(3, ["-m", "launch.rank", "configs/colocated.yaml"], timeout_s=60)
    assert result.returncode != 0 and not result.timed_out
    assert "world size 3 != num_host_ranks(1) + colocated dies(4) = 5" in result.output
