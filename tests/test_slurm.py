"""`xds-mpi submit` and its job script: layout and parsing without Slurm, real jobs with it.

The Slurm tests need a running Slurm (SLURM_CONF set, sbatch on PATH): `hpc/local_slurm.sh
run-tests python -m pytest tests` brings one up on this machine. Without one they skip, unless
XDS_MPI_SLURM=1 (set by run-tests and so in CI), where a missing Slurm fails them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from harness import REPO_ROOT

from launch.jobscript import default_time_limit, node_layout, parse_sweep
from xds_mpi.config import ConfigError, config_from_dict, load_config
from xds_mpi.runfile import read_run_file
from xds_mpi.topology import Topology

XDS_MPI = Path(sys.executable).parent / "xds-mpi"
COLOCATED = REPO_ROOT / "configs" / "colocated.yaml"
# A 5-rank job takes ~3 s on an idle 2-core machine but over 50 s when it is loaded (every rank
# imports torch): generous limits, so only a hung job fails on time.
JOB_TIMEOUT_S = 240


def xds_mpi(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None):
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


def topology(**deployment) -> Topology:
    # 64 routed experts so that up to 64 colocated dies each host one.
    return Topology.from_config(
        config_from_dict({"deployment": deployment, "model": {"num_routed_experts": 64}})
    )


# ---- without Slurm: layout, parsing, the script -------------------------------------------------


@pytest.mark.parametrize(
    "deployment, nodes, expected",
    [
        ({}, None, (5,)),  # colocated: 1 host + 4 dies, 1 server
        ({"dp_groups_per_domain": 16}, None, (17,)),  # exactly one server
        ({"dp_groups_per_domain": 20}, None, (17, 4)),  # server 0 + host, server 1's 4 dies
        ({"dp_groups_per_domain": 40}, 2, (33, 8)),  # servers [16,16,8]: 2 on node 0
        ({"dp_groups_per_domain": 20}, 1, (21,)),  # everything on one node
        ({}, 2, (3, 2)),  # more nodes than servers: split
    ],
)
def test_tasks_per_node_follow_the_server_layout(deployment, nodes, expected):
    assert node_layout(topology(**deployment), nodes).tasks_per_node == expected


def test_the_full_pod_takes_one_node_per_server():
    topo = Topology.from_config(load_config(REPO_ROOT / "configs" / "afd_pod.yaml"))
    layout = node_layout(topo)
    assert layout.num_nodes == 48
    assert layout.tasks_per_node == (16 + topo.num_host_ranks,) + (16,) * 47
    assert sum(layout.tasks_per_node) == topo.world_size


@pytest.mark.parametrize("nodes", [0, 6])
def test_nodes_outside_one_to_world_size_are_refused(nodes):
    with pytest.raises(ConfigError, match=f"between 1 and the 5 ranks .* got {nodes}"):
        node_layout(topology(), nodes)


def test_sweep_parses_key_and_values():
    sweep = parse_sweep("xccl.ring_slots=4, 8,16")
    assert (sweep.key, sweep.values) == ("xccl.ring_slots", ("4", "8", "16"))
    assert sweep.override(2) == "xccl.ring_slots=16"


@pytest.mark.parametrize(
    "text, message",
    [
        ("xccl.ring_slots", "--sweep expects section.key=v1,v2,..., got 'xccl.ring_slots'"),
        ("ring_slots=4,8", "--sweep expects section.key=v1,v2,..., got 'ring_slots=4,8'"),
        ("xccl.ring_slots=4,,8", "value 1 of 3 is empty"),
        ("run.name=a,b", "each element already gets its own run.name"),
    ],
)
def test_malformed_sweeps_are_refused(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_sweep(text)


def test_default_time_limit_is_run_timeout_plus_a_minute_rounded_up():
    assert default_time_limit(600) == "00:11:00"
    assert default_time_limit(61) == "00:03:00"
    assert default_time_limit(86400) == "1-00:01:00"


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-config"], "config 'no-such-config' is neither a file nor a name in configs/"),
        (["--sweep", "xccl.ring_slots"], "--sweep expects section.key=v1,v2,..."),
        (["--sweep", "xccl.ring_slot=4,8"], "--sweep element 0 (xccl.ring_slot=4): "),
        (["--sweep", "xccl.ring_slots=4,x"], "xccl.ring_slots must be int, got 'x'"),
        (
            ["--sweep", "deployment.dp_groups_per_domain=2,4"],
            "elements need different world sizes [3, 5]",
        ),
        (["--time", "ten"], "--time expects Slurm's MM, HH:MM:SS or D-HH:MM:SS, got 'ten'"),
        (["--nodes", "9"], "--nodes must be between 1 and the 5 ranks of the deployment, got 9"),
    ],
)
def test_bad_submit_input_is_one_line_and_exit_2(tmp_path, args, message):
    result = xds_mpi("submit", *args, "--dry-run", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_submit_without_sbatch_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    result = xds_mpi("submit", cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "sbatch not found on PATH" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_dry_run_names_config_ranks_nodes_and_launch_line(tmp_path):
    result = xds_mpi(
        "submit", "--dry-run", "--time", "00:05:00", "--partition", "debug", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert f"#   config     {COLOCATED}\n" in script
    assert "#   ranks      5 = 1 host rank(s) + 4 dies" in script
    assert "#   nodes      1, tasks per node: 5 " in script
    for line in [
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=5",
        "#SBATCH --time=00:05:00",
        "#SBATCH --partition=debug",
        f"#SBATCH --chdir={tmp_path}",
        "export MPIR_CVAR_CH4_RMA_ENABLE_DYNAMIC_AM_PROGRESS=1",
        "export MPIEXEC_TIMEOUT=600",
        "TASKS_PER_NODE=(5)",
    ]:
        assert line + "\n" in script, line
    launch = script[script.index("# Launch every rank") :]
    assert re.search(
        r"/mpiexec -n 5 -f \"\$HOSTFILE\" \\\n +\S+python\S* -m mpi4py -m "
        rf"launch.rank {re.escape(str(COLOCATED))} \\\n +\"\$\{{RUN_ARGS\[@\]\}}\"",
        launch,
    ), launch
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_dry_run_of_a_sweep_with_srun(tmp_path):
    result = xds_mpi(
        "submit",
        "--dry-run",
        "--launcher",
        "srun",
        "--set",
        "run.name=s",
        "--sweep",
        "xccl.ring_slots=4,8,16",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --array=0-2\n" in script
    for i, slots in enumerate([4, 8, 16]):
        assert (
            f"    {i}) RUN_ARGS=(--set xccl.ring_slots={slots} --set run.name=s-{i}) ;;" in script
        )
    assert "srun --mpi=pmi2 --distribution=arbitrary -n 5 \\\n" in script
    assert "export SLURM_HOSTFILE=$HOSTFILE\n" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


# ---- against a real Slurm -----------------------------------------------------------------------


def _slurm_missing() -> str | None:
    if not os.environ.get("SLURM_CONF"):
        return (
            "SLURM_CONF is not set; run under `hpc/local_slurm.sh run-tests ...` or source "
            "the environment `hpc/local_slurm.sh start` prints"
        )
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    out = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    missing = _slurm_missing()
    if missing and os.environ.get("XDS_MPI_SLURM") == "1":
        pytest.fail(f"XDS_MPI_SLURM=1 but no usable Slurm: {missing}")
    if missing:
        pytest.skip(missing)


@pytest.fixture(scope="module")
def timeout_job(slurm, tmp_path_factory):
    """A job whose launcher holds past a 1-minute limit. Slurm checks limits every 30 s, so it
    takes 60-90 s: it is submitted before the other Slurm tests and overlaps them."""
    workdir = tmp_path_factory.mktemp("timeout")
    slow = workdir / "slow-mpiexec"
    real = Path(sys.executable).parent / "mpiexec"
    # Answers --version at once (MPI detection at submit time), holds every launch.
    slow.write_text(
        f'#!/bin/bash\n[ "$1" = --version ] && exec {real} --version\nsleep 600\nexec {real} "$@"\n'
    )
    slow.chmod(0o755)
    proc = subprocess.Popen(
        [
            str(XDS_MPI),
            "submit",
            "--wait",
            "--time",
            "00:01:00",
            "--mpiexec",
            str(slow),
            "--set",
            "run.name=held",
        ],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, workdir, time.monotonic()
    if proc.poll() is None:
        proc.kill()


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_job_runs_to_completion_and_writes_its_run_file(timeout_job, tmp_path):
    started = time.monotonic()
    # run.check: the TE-shell compares every served token with the single-process reference.
    result = xds_mpi(
        "submit",
        "--wait",
        "--set",
        "run.name=single",
        "--set",
        "run.check=true",
        cwd=tmp_path,
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted job (\d+): 5 ranks on 1 node\(s\)", result.stdout).group(1)
    run_file = tmp_path / "runs" / "single.h5"
    assert f"job {job_id}: COMPLETED (exit 0:0" in result.stdout
    assert f"run file {run_file}" in result.stdout
    record = read_run_file(run_file)
    assert (record.name, record.status, record.world_size, record.num_dies) == (
        "single",
        "completed",
        5,
        4,
    )
    assert list(record.ranks["role"]) == ["host"] + ["colocated"] * 4
    assert record.config == load_config(COLOCATED, ["run.name=single", "run.check=true"])
    with h5py.File(run_file) as f:  # the decode results: all 8 requests served
        assert list(f["requests/status"].asstr()[()]) == ["done"] * 8
        assert f["summary"].attrs["check_mismatches"] == 0
    log = (tmp_path / "runs" / "jobs" / "single" / f"slurm-{job_id}.out").read_text()
    assert "summary: 8 requests served, 0 rejected" in log
    assert re.search(
        r"run completed; run file \S+\s+check: 8 requests, \d+ tokens, 0 mismatches$", log.rstrip()
    ), log[-2000:]
    assert f"run completed; run file {run_file}" in log
    print(f"single job: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_three_element_sweep_writes_three_run_files(slurm, tmp_path):
    started = time.monotonic()
    result = xds_mpi(
        "submit",
        "--wait",
        "--launcher",
        "srun",
        "--set",
        "run.name=sweep",
        "--sweep",
        "xccl.ring_slots=4,8,16",
        cwd=tmp_path,
        timeout=2 * JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted array job of 3 elements (\d+)", result.stdout).group(1)
    for i, slots in enumerate([4, 8, 16]):
        assert f"job {job_id}_{i}: COMPLETED (exit 0:0" in result.stdout, result.stdout
        record = read_run_file(tmp_path / "runs" / f"sweep-{i}.h5")
        assert (record.name, record.status, record.world_size) == (f"sweep-{i}", "completed", 5)
        assert record.config.xccl.ring_slots == slots
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.h5")) == [
        "sweep-0.h5",
        "sweep-1.h5",
        "sweep-2.h5",
    ]
    print(f"3-element sweep: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_job_over_its_time_limit_is_reported_as_timeout(timeout_job):
    proc, workdir, started = timeout_job
    stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 124, stdout + stderr
    job_id = re.search(r"submitted job (\d+)", stdout).group(1)
    assert f"job {job_id}: TIMEOUT" in stdout and "over its time limit 00:01:00" in stdout
    assert f"did not complete: {job_id} TIMEOUT" in stderr
    assert stderr.count("\n") == 1
    assert not (workdir / "runs" / "held.h5").exists()
    print(f"time-limit job: {time.monotonic() - started:.1f} s")
