"""Several job executors (`cluster.num_jes`, docs/cluster.md "Several JEs"): the frontend deals
the requests to the JEs in arrival order, each routes its share from its own view, and every TE
paces itself by the lowest of their promises. `xds-mpi run --check` equals the single-process
reference, each JE's round_robin turns on its own, the virtual columns are the same beside busy
processes, and a lost TE's requests are routed again by the JEs that routed them. Each run is
bounded by the subprocess timeout and run.timeout_s."""

from __future__ import annotations

import subprocess

import numpy as np
from harness import REPO_ROOT, busy_processes
from test_cluster import _ok, assert_same_columns, cluster_columns, run_mixed
from test_serving import XDS_MPI, check_line
from test_virtual_time import _sets


def test_validate_shows_the_jes_first_and_the_tes_after_them():
    result = subprocess.run(
        [str(XDS_MPI), "validate", "cluster", "--brief", *_sets("cluster.num_jes=2")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, _ok(result)
    assert "behind 2 JEs, policy least_load, world size 13" in result.stdout
    assert "  JEs: world ranks 0..1 " in result.stdout
    assert "  TE 0 (colocated, 2 dies): world ranks 2..4 (TE-shell 2;" in result.stdout


def test_two_jes_deal_in_arrival_order_route_in_turn_each_and_keep_their_virtual_times(tmp_path):
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = run_mixed(
                tmp_path / str(i), "cluster.num_jes=2", "cluster.policy=round_robin", name="jes"
            )
        assert result.returncode == 0, _ok(result)
        assert check_line(result).startswith("check: 18 requests, ")
        assert check_line(result).endswith(" 0 mismatches")
        assert run_file.attrs["world_size"] == 13
        assert run_file["summary"].attrs["num_jes"] == 2
        cluster = run_file["cluster"]
        order = np.lexsort((cluster["req_id"][()], run_file["virtual/arrival_s"][()]))
        je, te = cluster["je"][()][order], cluster["te"][()][order]
        assert list(je) == [k % 2 for k in range(18)]  # dealt in arrival order
        # each JE's k-th request to TE k mod 3: its own turn, not the other JE's (one JE would
        # route the k-th request of all to TE k mod 3)
        for j in (0, 1):
            assert list(te[je == j]) == [k % 3 for k in range(9)], j
        # each request's (decode) die is a die of its TE, by world rank
        die, first = run_file["requests/die_rank"][()], cluster["te_first_rank"][()]
        size, te_all = cluster["te_size"][()], cluster["te"][()]
        assert all(first[t] < d < first[t] + size[t] for t, d in zip(te_all, die, strict=True))
        assert len(cluster["decisions/req_id"]) == 18  # both JEs' decision logs
        runs.append(cluster_columns(run_file))
    quiet, loaded = runs
    assert_same_columns(quiet, loaded)
    # every request routed at its arrival: no JE held one back for the other
    assert np.array_equal(quiet["cluster/routed_s"], quiet["virtual/arrival_s"])


def test_three_jes_route_a_lost_te_s_requests_again_and_equal_the_reference(tmp_path):
    # colocated TE 0 lost whole at virtual 2.5 s, found at 2.5 + 1.5 + 0.2 = 4.2 s by every JE
    result, run_file = run_mixed(
        tmp_path,
        "cluster.num_jes=3",
        "cluster.te_losses=[{te: 0, at_s: 2.5}]",
        "health.timeout_s=1.5",
        name="jes",
    )
    assert result.returncode == 0, _ok(result)
    assert check_line(result).endswith(" 0 mismatches")
    cluster = run_file["cluster"]
    te, first, je = cluster["te"][()], cluster["first_te"][()], cluster["je"][()]
    again = first != te
    assert again.sum() >= 1 and set(first[again]) == {0} and 0 not in set(te[again])
    assert np.allclose(cluster["routed_s"][()][again], 4.2)
    assert all(run_file["virtual/finish_s"][()][te == 0] <= 2.5)
    assert len(set(je)) == 3
