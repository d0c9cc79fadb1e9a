"""What a job that did not end well leaves in shared memory is removed
(launch/job/shm_leftovers.py): only MPI segments that appeared while the job ran and that no
process has open or mapped."""

from __future__ import annotations

import mmap
import subprocess
import sys

from launch.job.shm_leftovers import ShmLeftovers, paths_in_use


def test_only_new_unused_mpi_segments_are_removed(tmp_path):
    (tmp_path / "mpich_shm_old_0").write_bytes(b"x" * 4096)  # there before the job: kept
    leftovers = ShmLeftovers(tmp_path)
    (tmp_path / "mpich_shm_left_0").write_bytes(b"x" * 8192)  # the job's, unused: removed
    (tmp_path / "sm_segment.host.1000.0").write_bytes(b"x")  # Open MPI's, unused: removed
    (tmp_path / "someone_else").write_bytes(b"x")  # not an MPI segment: kept
    (tmp_path / "mpich_shm_open_0").write_bytes(b"x" * 4096)  # open by a process: kept
    (tmp_path / "mpich_shm_mapped_0").write_bytes(b"x" * 4096)  # mapped by a process: kept
    with (
        open(tmp_path / "mpich_shm_open_0", "rb"),
        open(tmp_path / "mpich_shm_mapped_0", "r+b") as f,
    ):
        mapped = mmap.mmap(f.fileno(), 4096)
        f.close()  # the mapping alone holds it now
        try:
            assert {str(tmp_path / n) for n in ("mpich_shm_open_0", "mpich_shm_mapped_0")} <= (
                paths_in_use(tmp_path)
            )
            removed, held = leftovers.remove(settle_s=0.3)
        finally:
            mapped.close()
    assert removed == 2 and held >= 8192
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mpich_shm_mapped_0",
        "mpich_shm_old_0",
        "mpich_shm_open_0",
        "someone_else",
    ]


def test_nothing_new_nothing_said(tmp_path):
    lines: list[str] = []
    ShmLeftovers(tmp_path).remove_and_say(lines.append)
    assert lines == []
    leftovers = ShmLeftovers(tmp_path)
    (tmp_path / "mpich_shm_left_0").write_bytes(b"x" * 4096)
    leftovers.remove_and_say(lines.append)
    assert len(lines) == 1 and lines[0].startswith("xds-mpi: removed 1 shared-memory segment(s)")


def test_a_segment_held_by_an_exiting_rank_is_removed_once_it_is_gone(tmp_path):
    """mpiexec has exited, a rank it killed still maps the segment for a moment."""
    leftovers = ShmLeftovers(tmp_path)
    segment = tmp_path / "mpich_shm_late_0"
    segment.write_bytes(b"x" * 4096)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(path=str(segment))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert leftovers.remove(settle_s=0.0) == (0, 0)  # still mapped: kept
        assert leftovers.remove(settle_s=10.0)[0] == 1  # the holder exits after 0.5 s
    finally:
        holder.kill()
        holder.wait()
    assert not segment.exists()


HOLD = """
import mmap, time
f = open({path!r}, "r+b")
m = mmap.mmap(f.fileno(), 4096)
f.close()
print("mapped", flush=True)
time.sleep(0.5)
"""


def test_a_slurm_node_removes_what_changed_since_the_job_started(tmp_path):
    """`python -m launch.job.shm_leftovers --since START` (a job script on each node): no launcher
    listed the segments before the job, so a segment changed before START counts as before."""
    import time

    (tmp_path / "mpich_shm_earlier_0").write_bytes(b"x" * 4096)  # before the job: kept
    time.sleep(0.05)
    started = time.time()  # between the two (a ctime cannot be set back)
    time.sleep(0.05)
    (tmp_path / "mpich_shm_job_0").write_bytes(b"x" * 8192)  # the job's, unused: removed
    (tmp_path / "not_mpi").write_bytes(b"x")  # not an MPI segment: kept
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.job.shm_leftovers",
            "--since",
            str(started),
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "removed 1 shared-memory segment(s)" in result.stdout, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_earlier_0", "not_mpi"]
    bad = subprocess.run(
        [sys.executable, "-m", "launch.job.shm_leftovers"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--since" in bad.stderr
