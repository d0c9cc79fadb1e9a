"""`xds-mpi run --hosts` and `xds-mpi submit` place a cluster (configs/cluster.yaml: the JE + TEs
of 3, 3 and 5 ranks): dry runs print the hostfile and the job script with the cluster's world
(12 ranks), whole TEs per node; what cannot be placed is refused in one line. No MPI is started.
tests/e2e/hosts/test_two_hosts.py runs the cluster on two hosts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO_ROOT

from launch.cli import main as cli
from launch.job import memory_guard
from xds_mpi.config.schema import ConfigError

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def xds_mpi(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.parametrize(
    "flavor, lines",
    [
        ("mpich", ["h0:7", "h1:5"]),
        ("openmpi", ["h0 slots=7", "h1 slots=5"]),
    ],
)
def test_run_with_two_hosts_prints_a_hostfile_of_whole_tes(tmp_path, monkeypatch, flavor, lines):
    """[JE + TE 0 + TE 1, TE 2] = [7, 5] ranks: the largest host runs 7, where [4, 8] would
    run 8. The mpiexec line launches the cluster's 12 ranks."""
    mpiexec = _fake_mpiexec(tmp_path, flavor)
    result = xds_mpi(
        "run", "cluster", "--hosts", "h0,h1", "--mpiexec", mpiexec, "--dry-run", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    hostfile = re.findall(r"^# \S+/hosts/hosts-\d+: (.+)$", result.stdout, re.M)
    assert hostfile == lines, result.stdout
    assert re.search(r" -n 12 ", result.stdout), result.stdout
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def _fake_mpiexec(tmp_path: Path, flavor: str) -> str:
    """An mpiexec whose --version names the flavor (launch/job/mpiexec.py mpi_flavor)."""
    says = "HYDRA build details:" if flavor == "mpich" else "mpiexec (Open MPI) 4.1.5"
    path = tmp_path / f"mpiexec-{flavor}"
    path.write_text(f"#!/bin/sh\necho '{says}'\n")
    path.chmod(0o755)
    return str(path)


def test_run_with_more_hosts_than_tes_is_refused_in_one_line(tmp_path):
    result = xds_mpi("run", "cluster", "--hosts", "a,b,c,d", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "4 nodes (--nodes or --hosts) for a cluster of 3 TEs" in result.stderr
    assert "a TE spanning nodes is not supported" in result.stderr


@pytest.mark.parametrize(
    "nodes, tasks, most, window_mib, why",
    [
        ([], "4 3 5", 5, "1 1 1", "node 0: JE + TE 0; node 1: TE 1; node 2: TE 2"),
        # Node 0's windows: 4 x 282112 B (two colocated TEs) = 1.08 MiB, rounded up.
        (["--nodes", "2"], "7 5", 7, "2 1", "node 0: JE + TEs 0-1; node 1: TE 2"),
    ],
)
def test_submit_dry_run_launches_the_clusters_twelve_ranks(
    tmp_path, nodes, tasks, most, window_mib, why
):
    result = xds_mpi("submit", "cluster", *nodes, "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = result.stdout
    num_nodes = len(tasks.split())
    assert "#SBATCH --ntasks=12\n" in script
    assert f"#SBATCH --nodes={num_nodes}\n" in script
    assert f"#SBATCH --ntasks-per-node={most}\n" in script
    assert f"TASKS_PER_NODE=({tasks})\n" in script
    assert re.search(r"mpiexec -n 12 ", script), script
    assert "ranks      12 = 5 host rank(s) + 7 dies: cluster: 3 TEs" in script
    assert why in script
    assert f'--window-mib-per-node "{window_mib}"' in script, script


def test_submit_refuses_a_sweep_that_changes_the_clusters_world_size(tmp_path):
    """Two colocated TEs of 2 and of 4 dies: 7 and 11 ranks, two shapes for one array job."""
    result = xds_mpi(
        "submit", "colocated", "--set", "cluster.num_tes=2",
        "--sweep", "deployment.dp_groups_per_domain=2,4", "--dry-run", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "elements need different world sizes [7, 11]" in result.stderr, result.stderr


def test_submit_takes_a_sweep_that_keeps_the_clusters_world(tmp_path):
    result = xds_mpi(
        "submit", "cluster", "--sweep", "cluster.policy=round_robin,least_load", "--dry-run",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --ntasks=12\n" in result.stdout
    assert "#SBATCH --array=0-1\n" in result.stdout


def test_run_checks_this_node_for_every_tes_own_windows(monkeypatch, capsys):
    """The memory check before launch weighs the 12 ranks with the JE's window (0), the two
    colocated TEs' (2 x 282112 B each) and the PD pair's (2 x 413312 + 150912 B): 2105984 B,
    where TE 0's windows times 3 TEs would be 1692672 B. Nothing is launched."""
    weighed = []

    def check_node(num_ranks: int, window_bytes: int) -> None:
        weighed.append((num_ranks, window_bytes))
        raise ConfigError("stop before launch")

    monkeypatch.setattr(memory_guard, "check_node", check_node)
    monkeypatch.setattr(cli, "run_job", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.chdir(REPO_ROOT)
    assert cli.main(["run", "cluster"]) == 2
    assert "stop before launch" in capsys.readouterr().err
    assert weighed == [(12, 4 * 282112 + 2 * 413312 + 150912)]
