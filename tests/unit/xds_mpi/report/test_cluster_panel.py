"""The report's cluster panel reads a cluster's run file (/cluster, /virtual): each request's TE,
the TE it was first routed to (a lost TE's), the losses and scale events, each TE's JCTs and
the regret estimate, and the pool's ranks beside the scale events; a lone TE's run says it is
none."""

from __future__ import annotations

import h5py
import numpy as np

from xds_mpi.report.data import cluster_data, load_run
from xds_mpi.report.plots import cluster, serving_over_time
from xds_mpi.report.pool_plot import PoolSpan, pool, pool_spans


def _run_file(path, *, with_cluster: bool) -> None:
    strings = h5py.string_dtype()
    with h5py.File(path, "w") as f:
        f.create_group("summary")
        requests = f.create_group("requests")
        for name in ("ttft_s", "tpot_s", "die_rank"):
            requests[name] = np.zeros(4)
        virtual = f.create_group("virtual")
        virtual["req_id"] = np.arange(4)
        virtual["arrival_s"] = np.array([0.0, 0.5, 1.0, 1.5])
        virtual["finish_s"] = np.array([1.0, 2.5, 4.0, 2.0])
        virtual["first_token_s"] = np.array([0.2, 0.6, 3.5, 1.6])
        if not with_cluster:
            return
        c = f.create_group("cluster")
        c.attrs["policy"] = "least_load"
        c["req_id"] = np.arange(4)
        c["te"] = np.array([0, 1, 0, 1])
        c["first_te"] = np.array([0, 1, 2, 1])  # request 2 was on TE 2, lost
        c["routed_s"] = np.array([0.0, 0.5, 3.2, 1.5])
        c["te_kind"] = np.array(["colocated", "colocated", "pd"], dtype=strings)
        c["te_group"] = np.array(["a", "a", "pair"], dtype=strings)
        c["te_lost_s"] = np.array([np.nan, np.nan, 1.5])
        scaling = c.create_group("scaling")
        scaling["kind"] = np.array(["out", "in"], dtype=strings)
        scaling["te"] = np.array([1, 1])
        scaling["decided_s"] = np.array([0.2, 3.0])
        scaling["serves_s"] = np.array([0.4, np.inf])
        scaling["step_s"] = np.array([[0.1, 0.1], [0.0, 0.0]])
        scaling["step_name"] = np.array(["TE-Load", "Scaler-Post"], dtype=strings)
        pool = c.create_group("pool")  # rank 5: TE 1's die until 3.5 s, then TE 2's
        pool["te"] = np.array([1, 2])
        pool["rank"] = np.array([5, 5])
        pool["die"] = np.array([1, 1])
        pool["taken_s"] = np.array([0.2, 3.6])
        pool["given_back_s"] = np.array([3.5, np.inf])
        decisions = c.create_group("decisions")
        decisions["regret_s"] = np.array([0.0, 0.2, np.nan, 0.1])


def test_the_cluster_panel_reads_routing_losses_scaling_and_regret(tmp_path):
    path = tmp_path / "cluster.h5"
    _run_file(path, with_cluster=True)
    with h5py.File(path, "r") as f:
        data = cluster_data(f)
    assert list(data["first_te"] != data["te"]) == [False, False, True, False]
    assert np.allclose(data["jct_s"], [1.0, 2.0, 3.0, 0.5])
    assert np.allclose(data["ttft_s"], [0.2, 0.1, 2.5, 0.1])
    assert data["te_kind"] == ["colocated", "colocated", "pd"]
    assert data["scaling"]["kind"] == ["out", "in"] and data["policy"] == "least_load"
    assert data["scaling"]["step_name"] == ["TE-Load", "Scaler-Post"]
    png = cluster(load_run(path), tmp_path / "cluster.png")
    assert png.stat().st_size > 10_000


def test_the_pool_figure_puts_each_turn_beside_its_te_s_scale_events(tmp_path):
    """Rank 5's turn for TE 1: taken at its scale-out (0.2 s), serving from 0.4 s, drained at
    3.0 s, back at 3.5 s; for TE 2 (no scale-out event in this file: serving from its taking)
    to the run's last finish, 4.0 s."""
    path = tmp_path / "cluster.h5"
    _run_file(path, with_cluster=True)
    run = load_run(path)
    assert run.cluster["end_s"] == 4.0
    assert pool_spans(run.cluster) == [
        PoolSpan(rank=5, te=1, die=1, taken_s=0.2, serves_s=0.4, drained_s=3.0, end_s=3.5),
        PoolSpan(rank=5, te=2, die=1, taken_s=3.6, serves_s=3.6, drained_s=4.0, end_s=4.0),
    ]
    assert pool(run, tmp_path / "pool.png").stat().st_size > 5_000


def test_the_serving_tes_over_time_follow_the_scale_events():
    c = {
        "te_standby": np.array([False, True, True]),
        "arrival_s": np.array([0.0, 9.0]),
        "scaling": {
            "kind": ["out", "out", "in"],
            "decided_s": np.array([1.0, 2.0, 5.0]),
            "serves_s": np.array([1.5, np.inf, np.inf]),  # the second never served in the run
        },
    }
    assert serving_over_time(c, 3) == ([0.0, 1.5, 5.0, 9.0], [1, 2, 1, 1])


def test_a_lone_te_s_run_has_no_cluster_panel_data(tmp_path):
    path = tmp_path / "one.h5"
    _run_file(path, with_cluster=False)
    run = load_run(path)
    assert run.cluster == {}
    assert cluster(run, tmp_path / "one.png").exists()
    assert pool(run, tmp_path / "pool.png").exists()
