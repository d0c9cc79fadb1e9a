"""The node's memory against the job (launch/job/memory_guard.py): a job that cannot fit is refused
before anything starts, a running job is stopped before the node runs out (mpiexec and every
rank gone), and OOM kills during a failed job are named."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from harness import REPO_ROOT
from test_launcher_signals import MARKER_ENV, job_pids, mpi_segments

from launch.cli import main as cli
from launch.job import memory_guard
from launch.job.memory_guard import MemoryWatch, NodeMemory, NodeOutOfMemory, check_fits
from launch.job.mpiexec import MpiCommand, run_job
from launch.serve import command as serve
from xds_mpi.config.schema import ConfigError

GIB = 1024  # MiB

MEMINFO = "MemTotal:       24684028 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n"


def fake_node(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc with meminfo and self/cgroup, and a cgroup file system holding `files`."""
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (fs / name).parent.mkdir(parents=True, exist_ok=True)
        (fs / name).write_text(text)
    return proc, fs


def test_without_a_cgroup_limit_the_node_has_its_memavailable(tmp_path):
    proc, fs = fake_node(tmp_path, "0::/user.slice\n", {"user.slice/memory.max": "max\n"})
    memory = memory_guard.read_node_memory(proc, fs)
    assert memory.source == "MemAvailable"
    assert memory.available_mib == pytest.approx(20000000 / 1024)
    assert memory.total_mib == pytest.approx(24684028 / 1024)


def test_a_cgroup_v2_limit_on_an_ancestor_binds(tmp_path):
    """Slurm limits the job's cgroup; the step runs in a child of it. The inactive file cache
    the cgroup can drop does not count as used."""
    files = {
        "job_7/memory.max": str(8 << 30),
        "job_7/memory.current": str(6 << 30),
        "job_7/memory.stat": f"anon 1\ninactive_file {1 << 30}\n",
        "job_7/step_0/memory.max": "max",
        "job_7/step_0/memory.current": str(5 << 30),
    }
    proc, fs = fake_node(tmp_path, "0::/job_7/step_0\n", files)
    memory = memory_guard.read_node_memory(proc, fs)
    assert memory.source == "cgroup /job_7"
    assert memory.available_mib == 3 * GIB  # 8 - (6 - 1) GiB
    assert memory.total_mib == 8 * GIB


def test_a_cgroup_v1_memory_limit_binds(tmp_path):
    files = {
        "memory/slurm/job_9/memory.limit_in_bytes": str(4 << 30),
        "memory/slurm/job_9/memory.usage_in_bytes": str(3 << 30),
    }
    proc, fs = fake_node(tmp_path, "5:cpuset:/\n4:memory:/slurm/job_9\n", files)
    memory = memory_guard.read_node_memory(proc, fs)
    assert (memory.source, memory.available_mib) == ("cgroup /slurm/job_9", 1 * GIB)


def test_a_job_that_cannot_fit_is_refused_with_both_numbers():
    node = NodeMemory(available_mib=12 * GIB, total_mib=24 * GIB, source="MemAvailable")
    with pytest.raises(ConfigError) as refused:
        check_fits(769, 150 << 30, node)
    text = str(refused.value)
    assert "769 ranks need at least 24.0 GiB" in text and "12.0 GiB available" in text
    assert "nothing was launched" in text and "--no-memory-check" in text
    warning = check_fits(289, 10 << 30, node)
    assert warning.startswith("xds-mpi: warning: 289 ranks need 9.0 GiB to 19.0 GiB")
    assert check_fits(65, 1 << 30, node) is None
    assert check_fits(769, 150 << 30, None) is None  # not Linux: nothing known, nothing said


def test_run_refuses_before_launching_anything(monkeypatch, capsys):
    """afd_pod's 769 ranks on a node with 12 GiB left: exit 2, and no mpiexec started."""
    small = NodeMemory(available_mib=12 * GIB, total_mib=24 * GIB, source="MemAvailable")
    monkeypatch.setattr(memory_guard, "read_node_memory", lambda: small)
    launched = []
    monkeypatch.setattr(cli, "run_job", lambda *a, **k: launched.append(a))
    monkeypatch.chdir(REPO_ROOT)
    assert cli.main(["run", "afd_pod"]) == 2
    err = capsys.readouterr().err
    assert "xds-mpi: error: 769 ranks need at least 24.0 GiB on this node" in err
    assert launched == []


def node_with(available_mib: float) -> NodeMemory:
    return NodeMemory(available_mib=available_mib, total_mib=24 * GIB, source="MemAvailable")


def test_the_watch_stops_only_under_the_floor():
    floor = max(memory_guard.FLOOR_MIB, memory_guard.FLOOR_SHARE * 24 * GIB)  # 492 MiB here
    readings = iter([node_with(floor + 1), node_with(floor - 1)])
    watch = MemoryWatch(read=lambda: next(readings), kills=lambda: 0)
    watch.poll()
    with pytest.raises(NodeOutOfMemory, match="running out of memory"):
        watch.poll()
    quiet = MemoryWatch(stops=False, read=lambda: node_with(1), kills=lambda: 0)
    quiet.poll()  # --no-memory-check: looks, never stops
    assert quiet.lowest.available_mib == 1


def test_oom_kills_during_the_job_are_named():
    counts = iter([3, 5])
    watch = MemoryWatch(read=lambda: node_with(900), kills=lambda: next(counts))
    watch.poll()
    message = watch.after()
    assert "OOM killer ended 2 process(es) on this node during the job" in message
    assert "0.9 GiB available" in message
    assert MemoryWatch(read=lambda: None, kills=lambda: 4).after() is None  # no rise


def test_a_running_job_is_stopped_when_the_node_runs_low():
    """run_job's every-second call raises; the job's process is gone."""
    readings = iter([node_with(8 * GIB), node_with(100)])
    watch = MemoryWatch(read=lambda: next(readings), kills=lambda: 0)
    command = MpiCommand(argv=("sleep", "60"), env={})
    started = time.monotonic()
    with pytest.raises(NodeOutOfMemory):
        run_job(command, timeout_s=60, while_waiting=watch.poll)
    assert time.monotonic() - started < 20


@pytest.mark.timeout(180)
def test_the_main_job_is_stopped_when_the_node_runs_low(monkeypatch, capfd, tmp_path):
    """The main job launched, then the node reported low on memory: exit 3 with the numbers,
    and mpiexec and every rank are gone."""
    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER_ENV, marker)
    segments_before = mpi_segments()
    readings = {"calls": 0}

    def read():
        readings["calls"] += 1  # the check before launch, then every second from launch
        return node_with(20 * GIB if readings["calls"] <= 2 else 100)

    monkeypatch.setattr(memory_guard, "read_node_memory", read)
    monkeypatch.chdir(REPO_ROOT)
    # 8192 tokens: ~15 s of serving at today's ~550 tok/s, well past the watch's first low
    # reading (1-2 s after launch); 64 requests of 16 tokens ended before it once the job got fast.
    long_run = [
        "workload.num_requests=64",
        "workload.output_len=128",
        "workload.max_output_len=128",
    ]
    sets = [f"run.output_dir={tmp_path}", *long_run]
    code = cli.main(["run", *[arg for value in sets for arg in ("--set", value)]])
    err = capfd.readouterr().err
    assert code == memory_guard.EXIT_OUT_OF_MEMORY, err[-3000:]
    assert "xds-mpi: error: the node is running out of memory (0.1 GiB available" in err
    deadline = time.monotonic() + 10
    while job_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_pids(marker) == []
    assert mpi_segments() <= segments_before, "the job's windows were left in /dev/shm"
    assert "shared-memory segment(s) the job left in /dev/shm" in err


def test_serve_stops_the_job_when_the_node_runs_low(tmp_path, capsys):
    watch = MemoryWatch(read=lambda: node_with(100), kills=lambda: 0)
    started = time.monotonic()
    code = serve._run(("sleep", "60"), {}, tmp_path / "te_shell.pid", 60.0, 10.0, watch)
    assert code == memory_guard.EXIT_OUT_OF_MEMORY
    assert "running out of memory" in capsys.readouterr().err
    assert time.monotonic() - started < 20
