"""A two-node Slurm job (tests/two_node_slurm.py): `xds-mpi submit --nodes 2 --wait` of a
two-server deployment with the check on ends COMPLETED with 0 mismatches, each server's dies ran
on its node (the run file's rank table: Slurm's node name of every rank), and XCCL crossed nodes.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import h5py
import pytest
from two_hosts import can_make_hosts, two_hosts
from two_node_slurm import slurm_missing, two_node_slurm

from xds_mpi.report.runfile import read_run_file

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def _why_not() -> str:
    why = can_make_hosts() or slurm_missing()
    if why and os.environ.get("XDS_MPI_SLURM") == "1" and not can_make_hosts():
        return ""  # in CI Slurm is installed: a missing one must fail, not skip
    return why


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "n/a")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # munged wants every directory above its socket open to all: not pytest's 0700 tmp dirs.
    root = Path(tempfile.mkdtemp(prefix="xds-two-node-slurm-"))
    root.chmod(0o755)
    try:
        with two_hosts(root) as hosts, two_node_slurm(hosts, root / "slurm") as made:
            yield made
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_two_node_job_completes_with_each_server_on_its_node(cluster, tmp_path):
    sets = ["hardware.chips_per_server=1", "run.check=true"]
    sets += [f"run.output_dir={tmp_path}", "run.name=two"]
    argv = [str(XDS_MPI), "submit", "colocated", "--nodes", "2", "--wait"]
    argv += [a for s in sets for a in ("--set", s)]
    out = cluster.run(argv, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert re.search(r"job \d+: COMPLETED", text), text
    run = read_run_file(tmp_path / "two.h5")
    assert run.status == "completed", run.status
    names = cluster.hosts.names
    for rank, server in enumerate(run.ranks["server"]):
        expected = names[0] if server <= 0 else names[1]  # host ranks and server 0 on node 0
        assert run.ranks["host"][rank] == expected, (rank, list(run.ranks["host"]))
    with h5py.File(tmp_path / "two.h5") as f:
        summary = dict(f["summary"].attrs)
    assert summary["check_mismatches"] == 0, summary
    assert summary["cross_node_polls"] > 0 and summary["cross_node_rma_ops"] > 0, summary
