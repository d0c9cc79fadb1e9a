"""The `xds-mpi` command: validate every shipped config, refuse bad ones in one line, launch."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO_ROOT

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def xds_mpi(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )


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
    assert "routed 12-15; shared 0" in lines[-1]
    assert "waits: auto (the default): sleep on a futex when a node runs" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "deployment.num_dies=3"], "unknown key 'num_dies' in section 'deployment'"),
        (["--np", "7"], "world size 7 != num_host_ranks(1) + colocated dies(4) = 5"),
        (
            ["--set", "deployment.max_routed_experts_per_die=3"],
            "model.num_routed_experts(16) do not fit into 4 routed-expert dies x "
            "max_routed_experts_per_die(3) = 12 slots",
        ),
        (["no-such-config"], "config 'no-such-config' is neither a file nor a name in configs/"),
    ],
)
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
    assert " -n 8 " in line and "-m mpi4py -m launch.job.rank" in line
    assert "MPIEXEC_TIMEOUT=77" in line and "--set run.timeout_s=77" in line


def test_ranks_get_small_pages_from_numpy_unless_the_user_chose(monkeypatch):
    from launch.job.mpiexec import mpi_command

    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    assert mpi_command(2, ["true"]).env["NUMPY_MADVISE_HUGEPAGE"] == "0"
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    assert "NUMPY_MADVISE_HUGEPAGE" not in mpi_command(2, ["true"]).env


def test_run_refuses_a_wrong_np_before_launching():
    result = xds_mpi("run", "--np", "3")
    assert result.returncode == 2 and "world size 3 != " in result.stderr
    assert "launching" not in result.stdout


@pytest.mark.parametrize(
    "config, world_size", [("colocated", 5), pytest.param("afd", 8, marks=pytest.mark.long)]
)
def test_run_brings_up_every_rank(config, world_size):
    result = xds_mpi("run", config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all {world_size} ranks agree on the deployment" in result.stdout
    assert "[r0 host]" in result.stdout
    # Every rank but 0 said it was built, with its start-up CPU and memory (ranks/core/ready.py).
    ready = re.search(
        rf"start-up: all {world_size - 1} ranks ready in [\d.]+ s; CPU per rank median "
        r"([\d.]+) s, max ([\d.]+) s; PSS per rank median (\d+) MiB",
        result.stdout,
    )
    assert ready, result.stdout
    assert 0 < float(ready[1]) <= float(ready[2]) and int(ready[3]) > 0


def test_the_rank_entry_runs_under_plain_mpiexec():
    # What a user types by hand, without the launcher (the launcher adds only env and flags).
    from harness import run_mpi

    result = run_mpi(5, ["-m", "launch.job.rank", "configs/colocated.yaml"], timeout_s=60)
    assert result.returncode == 0, result.output
    assert "all 5 ranks agree" in result.output


@pytest.mark.parametrize("overrides", [[], ["run.name=a b", "model.top_k=2"], ["x.y=--set"]])
def test_the_rank_entry_reads_back_what_the_launcher_writes(overrides):
    """launch/job/mpiexec.py rank_program -> launch/job/rank.py parse_args is a round trip."""
    from launch.job.mpiexec import rank_program
    from launch.job.rank import RankArgs, parse_args

    program = rank_program("configs/colocated.yaml", overrides)
    assert program[:5] == [sys.executable, "-m", "mpi4py", "-m", "launch.job.rank"]
    assert parse_args(program[5:]) == RankArgs(config="configs/colocated.yaml", overrides=overrides)
    resolved = Path("runs/.config/c-0.resolved.json")
    program = rank_program("configs/colocated.yaml", overrides, resolved)
    assert parse_args(program[5:]) == RankArgs(
        config="configs/colocated.yaml", overrides=overrides, resolved=str(resolved)
    )
    assert parse_args(["c.yaml", "--set=a.b=1"]) == RankArgs(config="c.yaml", overrides=["a.b=1"])


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "a CONFIG is required"),
        (["c.yaml", "--set"], "--set needs SECTION.KEY=VALUE"),
        (["c.yaml", "--resolved"], "--resolved needs a FILE"),
        (["c.yaml", "d.yaml"], "unrecognized argument 'd.yaml'"),
        (["c.yaml", "--sett", "a.b=1"], "unrecognized argument '--sett'"),
    ],
)
def test_the_rank_entry_refuses_other_arguments_with_its_usage(argv, message):
    from launch.job.rank import USAGE, parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert str(stop.value) == f"{USAGE}\nlaunch.rank: {message}"


def test_the_handshake_digest_tells_configs_that_differ_in_one_value_apart():
    """ranks/core/context.py config_digest (a CRC-32 of the config as JSON): equal for equal
    configs, different for each single changed value."""
    import logging

    from ranks.core.context import RankContext
    from xds_mpi.config.schema import config_from_dict
    from xds_mpi.plan.deployment import DeploymentPlan

    def digest(*sets: str) -> str:
        plan = DeploymentPlan.build(config_from_dict({}, sets), launcher_checks=False)
        return RankContext(
            plan=plan, comm=None, log=logging.getLogger(), node_leader=0
        ).config_digest()

    changed = ["model.seed=1", "run.name=other", "xccl.poll_timeout_s=31", "workload.seed=1"]
    digests = [digest(), digest(), *(digest(one) for one in changed)]
    assert digests[0] == digests[1]
    assert len(set(digests)) == 1 + len(changed)


def test_the_rank_entry_refuses_a_wrong_world_size_on_every_rank():
    from harness import run_mpi

    result = run_mpi(3, ["-m", "launch.job.rank", "configs/colocated.yaml"], timeout_s=60)
    assert result.returncode != 0 and not result.timed_out
    assert "world size 3 != num_host_ranks(1) + colocated dies(4) = 5" in result.output


def test_validate_prints_window_sizes_and_refuses_a_layout_over_the_cap():
    ok = xds_mpi("validate", "--set", "xccl.p2p_pairs=all")
    assert ok.returncode == 0, ok.stderr
    # 4 dies, all pairs: 64 B x (2 x 4 in + 4 out) records + 4 rings x 8 x 64 KiB = 2,097,920 B
    # of p2p, + 544,256 B of dispatch/combine (see EpLayout) = 2,642,176 B = 2.5 MiB
    assert "largest die window 2.5 MiB" in ok.stdout
    over = xds_mpi(
        "validate", "--set", "xccl.p2p_pairs=all", "--set", "xccl.max_window_bytes=100000"
    )
    assert over.returncode == 2
    assert (
        "rank 1's window needs 2642624 B = p2p 2097920 B + dispatch/combine 544704 B, over "
        "the per-die cap xccl.max_window_bytes(100000)"
    ) in over.stderr


def test_bench_p2p_reports_ratios_and_the_projected_latency(tmp_path):
    import csv

    out = tmp_path / "p2p.csv"
    result = xds_mpi(
        "bench",
        "p2p",
        "--sizes",
        "64",
        "12000",
        "--cores",
        "2",
        "--iters",
        "5",
        "--slots",
        "4",
        "--slot-bytes",
        "4096",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rtt_vs_put" in result.stdout
    rows = list(csv.DictReader(out.open()))
    assert [int(r["bytes"]) for r in rows] == [64, 12000]
    for row in rows:
        assert float(row["xccl_rtt_us"]) > 0 and float(row["put_rtt_us"]) > 0
        for column in ("xccl_direct_gb_s", "xccl_rma_direct_gb_s"):  # received in window memory
            assert float(row[column]) > 0
        assert float(row["direct_bw_vs_put"]) == pytest.approx(
            float(row["xccl_direct_gb_s"]) / float(row["put_gb_s"]), rel=1e-2
        )
        floor = float(row["floor_rtt_us"])  # nan only where no peer is reached by load/store
        assert floor > 0 or math.isnan(floor)
        if floor > 0:
            assert float(row["rtt_vs_floor"]) == pytest.approx(
                float(row["xccl_rtt_us"]) / floor, rel=1e-2
            )
        expected_ns = projected_send_ns(int(row["bytes"]), ring_bytes=4 * 4096, num_cores=2)
        assert float(row["proj_910c_send_us"]) == pytest.approx(expected_ns / 1e3, rel=1e-6)


def projected_send_ns(nbytes: int, *, ring_bytes: int, num_cores: int) -> float:
    """One sync send on the 910C profile's virtual clock, dies on two servers."""
    from xccl.vclock import LinkModel
    from xds_mpi.config.hardware import load_profile

    link = LinkModel.from_profile(load_profile("ascend910c"))
    # Two publications of at most half a ring each serialize on the link (no flow-control wait
    # with two in flight), the last one's arrival (the ack word carries whole ns) plus the ack's
    # latency completes it.
    half_ring = ring_bytes // 2
    last = nbytes - (max(nbytes - 1, 0) // half_ring) * half_ring
    arrival_ns = link.serialization_ns(nbytes - last, num_cores=num_cores) + link.transfer_ns(
        last, num_cores=num_cores
    )
    return math.floor(arrival_ns) + link.latency_ns()


def test_bench_ep_checks_itself_against_alltoallv_and_reports(tmp_path):
    import csv

    out = tmp_path / "ep.csv"
    result = xds_mpi(
        "bench",
        "ep",
        "--np",
        "2",
        "--tokens",
        "3",
        "8",
        "--hidden",
        "32",
        "--topk",
        "2",
        "--experts",
        "4",
        "--iters",
        "3",
        "--int8",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.open()))
    assert [int(r["tokens"]) for r in rows] == [3, 8]
    assert all(float(r["speedup"]) > 0 and float(r["proj_910c_us"]) > 0 for r in rows)
    # the meeting floor ran on the load/store path (one node): a time, and xccl's ratio to it
    assert all(0 < float(r["floor_us"]) < math.inf and float(r["vs_floor"]) > 0 for r in rows)
    bad = xds_mpi("bench", "ep", "--np", "3", "--experts", "256")
    assert bad.returncode == 2 and "--experts(256) must be a multiple of --np(3)" in bad.stderr


def test_a_run_over_its_time_limit_is_reported_as_such():
    # A run (rank start-up, serving 64 requests, the check) takes longer than one second: the
    # main job alone served in 0.2 s on a quiet machine and was killed while it closed.
    result = xds_mpi(
        "run", "--check", "--set", "run.timeout_s=1", "--set", "workload.num_requests=64"
    )
    assert result.returncode == 124, result.stdout[-2000:] + result.stderr[-2000:]
    assert "job exceeded run.timeout_s(1) and was killed" in result.stderr


def test_run_refuses_a_checkpoint_of_another_shape_before_launch():
    result = xds_mpi("run", "--set", "model.hidden=7")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.hidden: checkpoint 128 vs config 7" in result.stderr
    assert "launching" not in result.stdout
