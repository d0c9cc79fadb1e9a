"""Two hosts (network namespaces, tests/two_hosts.py): the XCCL protocol bodies and served runs
with ranks on both hosts. The cross-node path must really be taken: every run's windows count
the polls that went through Fetch_and_op and the RMA operations between hosts, and both must be
non-zero; the run file's rank table shows which host each rank ran on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import KILL_GRACE_S, MPI_DIR, REPO_ROOT, body_args, explain
from two_hosts import can_make_hosts, two_hosts

from launch.job.mpiexec import mpi_command, run_job
from xds_mpi.report.runfile import read_run_file

pytestmark = pytest.mark.skipif(bool(can_make_hosts()), reason=can_make_hosts() or "n/a")
XDS_MPI = Path(sys.executable).parent / "xds-mpi"
TRAFFIC = re.compile(r"xccl traffic rank (\d+): remote_polls=(\d+) remote_rma=(\d+)")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with two_hosts(tmp_path_factory.mktemp("two-hosts")) as made:
        yield made


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("body_p2p.py", marks=pytest.mark.long),
        pytest.param("body_ep.py", marks=pytest.mark.long),  # the served run below crosses too
        pytest.param("body_afd.py", marks=pytest.mark.long),
        "body_far_pull.py",  # A and B on one host, C on the other: the afd_pod deadlock
    ],
)
def test_a_protocol_body_passes_across_two_hosts(hosts, tmp_path, body):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{hosts.names[0]}:2\n{hosts.names[1]}:2\n")
    program = [sys.executable, "-m", "mpi4py", *body_args([MPI_DIR / body], 240)]
    command = mpi_command(4, program, timeout_s=240, placement=("-f", str(hostfile)))
    command = hosts.wrap(command)
    env = {**command.env, "XDS_PRINT_TRAFFIC": "1"}
    result = run_job(
        command.__class__(argv=command.argv, env=env),
        timeout_s=240 + KILL_GRACE_S,
        capture=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, explain(result)
    passed = re.findall(r"(\d+) passed", result.output)
    assert len(passed) == 4 and all(int(n) > 0 for n in passed), explain(result)
    traffic = {int(r): (int(p), int(m)) for r, p, m in TRAFFIC.findall(result.output)}
    assert sorted(traffic) == [0, 1, 2, 3], explain(result)
    print(f"\n{body} across hosts, per rank (polls, RMA operations): {traffic}")
    assert sum(p for p, _ in traffic.values()) > 0, f"no poll crossed hosts: {traffic}"
    assert sum(m for _, m in traffic.values()) > 0, f"no RMA crossed hosts: {traffic}"


AFD_POD_REDUCED = [
    "deployment.dp_groups_per_domain=4",
    "deployment.num_expert_dies=9",
    "deployment.num_shared_expert_dies=1",
    "model.num_routed_experts=32",
    "model.weights=random",
    "workload.num_requests=12",
]


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("colocated", ["hardware.chips_per_server=1"]),
        pytest.param("afd", ["hardware.chips_per_server=2"], marks=pytest.mark.long),
        # afd_pod's structure at a width two namespaces serve (docs/scale.md): 3 DP domains,
        # trampolines, 12 attention dies : 9 expert dies (not an integer ratio), 2 servers.
        pytest.param(
            "afd_pod",
            AFD_POD_REDUCED,
            marks=[
                pytest.mark.long,
                pytest.mark.timeout(1500),
            ],
            id="afd_pod-reduced",
        ),
    ],
)
def test_a_served_run_checks_equal_with_dies_on_both_hosts(hosts, tmp_path, config, overrides):
    sets = [
        a for o in [*overrides, f"run.output_dir={tmp_path}", "run.name=two"] for a in ("--set", o)
    ]
    argv = [str(XDS_MPI), "run", config, "--check", "--hosts", ",".join(hosts.names), *sets]
    out = subprocess.run(
        hosts.on(0, argv),
        env={**os.environ, **hosts.env},
        capture_output=True,
        text=True,
        timeout=1400,  # under pytest-timeout's limit for each case
        cwd=REPO_ROOT,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert re.search(r"check: \d+ requests, \d+ tokens, 0 mismatches", text), text[-3000:]
    run = read_run_file(tmp_path / "two.h5")
    # Every die of a server ran on the host the hostfile gave that server; host ranks on host 0.
    servers = sorted({int(s) for s in run.ranks["server"] if s >= 0})
    for rank, server in enumerate(run.ranks["server"]):
        expected = (
            hosts.names[0] if server < 0 else hosts.names[servers.index(server) * 2 // len(servers)]
        )
        assert run.ranks["host"][rank] == expected, (rank, server, list(run.ranks["host"]))
    import h5py

    with h5py.File(tmp_path / "two.h5") as f:
        summary = dict(f["summary"].attrs)
    crossed = {k: int(v) for k, v in summary.items() if k.startswith("cross_node")}
    print(f"\n{config} across hosts: {crossed}")
    assert summary["cross_node_polls"] > 0 and summary["cross_node_rma_ops"] > 0, summary


def test_a_cluster_runs_whole_tes_on_each_host(hosts, tmp_path):
    """configs/cluster.yaml (the JE + TEs of 3, 3 and 5 ranks) with --hosts h0,h1: world ranks
    0-6 (the JE, both colocated TEs) on host 0 and 7-11 (the PD pair) on host 1, seen in each
    namespace's processes while the job runs; the JE's link crosses the hosts and every token
    equals the reference. No TE spans the hosts, so no window is reached across them (the run
    file, the JE's, has no rank table of hosts): where the ranks ran is the proof."""
    sets = [a for o in [f"run.output_dir={tmp_path}", "run.name=cluster"] for a in ("--set", o)]
    argv = [str(XDS_MPI), "run", "cluster", "--check", "--hosts", ",".join(hosts.names), *sets]
    job = subprocess.Popen(
        hosts.on(0, argv),
        env={**os.environ, **hosts.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
    )
    seen: dict[int, set[int]] = {0: set(), 1: set()}  # host -> world ranks seen running there
    while job.poll() is None:
        for idx in (0, 1):
            seen[idx] |= _ranks_in(hosts.namespaces[idx])
        time.sleep(0.2)
    text = job.stdout.read()
    assert job.returncode == 0, text[-6000:]
    assert re.search(r"check: 24 requests, \d+ tokens, 0 mismatches", text), text[-3000:]
    assert seen == {0: set(range(7)), 1: set(range(7, 12))}, seen


def _ranks_in(namespace: str) -> set[int]:
    """The world ranks (MPICH's PMI_RANK) of the rank processes in a network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    ranks = set()
    for pid in pids.stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        if b"launch.job.rank" not in cmdline:
            continue
        ranks |= {int(v[len(b"PMI_RANK=") :]) for v in environ if v.startswith(b"PMI_RANK=")}
    return ranks
