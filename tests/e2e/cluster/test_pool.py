"""A pool of ranks (docs/cluster.md "A pool of ranks"): a serving colocated TE of 1 die and two
pool TEs of different shapes (1 die, 2 dies) sharing `cluster.pool` 2 ranks, 7 ranks in all. Two
bursts: the first scales out to the 1-die pool TE (its die on pool rank 5) while the 2-die one
waits for ranks; after the burst the 1-die TE is drained and its rank goes back to the pool; the
second burst scales out to the 2-die TE on pool ranks 5 and 6, so rank 5 serves a TE of another
shape. `--check` 0 mismatches on every request, those the pool TEs served with the weights they
loaded included. Bounded by the subprocess timeout and run.timeout_s."""

from __future__ import annotations

import json
import subprocess

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT
from test_cluster import AUTOSCALE, _ok, assert_all_checked
from test_serving import XDS_MPI, check_line
from test_virtual_time import _jsonl, _sets

from launch.report.run_page import write_report
from xds_mpi.config.schema import load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.report.trace_writer import trace_path

POOL_TES = (
    "cluster.groups=[{count: 1}, "
    "{count: 1, standby: true, pool: true, name: one-die, set: [scaling.path=PATH]}, "
    "{count: 1, standby: true, pool: true, name: two-dies, "
    "set: [deployment.dp_groups_per_domain=2]}]"
)
SETS = (
    "cluster.policy=least_load",
    "deployment.dp_groups_per_domain=1",
    "health.enabled=false",
    "workload.ignore_eos=true",
    *AUTOSCALE,
    "run.timeout_s=120",
)


def _bursts(tmp_path) -> tuple[list[dict], list[str]]:
    """1 request/s, 32 at 16/s from 3 s, 1/s, 32 at 16/s from 12 s, 1/s."""
    times = [0.0, 1.0, 2.0] + [3 + i / 16 for i in range(32)] + [6.0, 7.0, 8.0]
    times += [12 + i / 16 for i in range(32)] + [16.0, 17.0]
    lines = [
        {"prompt_ids": list(range(3 + i % 7, 19 + i % 7)), "max_tokens": 12, "arrival_s": t}
        for i, t in enumerate(times)
    ]
    return lines, _jsonl(tmp_path, lines)


def _run(tmp_path, path: str, *more: str, pool: int = 2, name: str = "pool"):
    lines, workload = _bursts(tmp_path)
    sets = _sets(
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        POOL_TES.replace("PATH", path),
        *SETS,
        f"cluster.pool={pool}",
        *more,
    )
    result = subprocess.run(
        [str(XDS_MPI), "run", "colocated", "--check", *workload, *sets],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    run_file = tmp_path / f"{name}.h5"
    return lines, result, (h5py.File(run_file, "r") if run_file.exists() else None)


def _column(group, key) -> list:
    return [v.decode() if isinstance(v, bytes) else v for v in group[key][()]]


@pytest.mark.parametrize("path", ["dram", "fork"])
def test_two_pool_shapes_share_one_pool_and_a_drained_te_s_rank_serves_the_other(tmp_path, path):
    lines, result, run_file = _run(tmp_path, path, "run.trace=true")
    assert_all_checked(result, lines)
    scaling = run_file["cluster/scaling"]
    events = list(zip(_column(scaling, "kind"), _column(scaling, "te"), strict=True))
    assert events == [("out", 1), ("in", 1), ("out", 2)], events
    # each pool TE loaded its weights on its scale-out: TE 1 by the path, TE 2 from DRAM
    assert _column(scaling, "load_path") == [path, "", "dram"]
    assert list(scaling["load_bytes"][()][[0, 2]]) == [8152192, 10012928]
    pool = run_file["cluster/pool"]
    rows = list(zip(*(_column(pool, k) for k in ("te", "rank", "die")), strict=True))
    assert rows == [(1, 5, 1), (2, 5, 1), (2, 6, 2)]  # rank 5: TE 1's die, then TE 2's
    given_back = pool["given_back_s"][()]
    drained_s = scaling["decided_s"][1]
    assert given_back[0] == drained_s and np.isinf(given_back[1:]).all()
    assert pool.attrs["waits"] > 0  # TE 2 waited for ranks during the first burst
    # the requests each pool TE served ran on its pool ranks, and only while it served
    te, routed = run_file["cluster/te"][()], run_file["cluster/routed_s"][()]
    die_rank = run_file["requests/die_rank"][()]
    serves = scaling["serves_s"][()]
    on_1, on_2 = te == 1, te == 2
    assert on_1.sum() > 0 and on_2.sum() > 0
    assert set(die_rank[on_1]) == {5} and set(die_rank[on_2]) == {5, 6}
    assert routed[on_1].min() >= serves[0] and routed[on_1].max() <= drained_s
    assert routed[on_2].min() >= serves[2]
    assert run_file.attrs["world_size"] == 7
    # the JE's trace: a track per pool rank, a span per turn as the rows say (microseconds)
    trace = json.loads(trace_path(tmp_path / "pool.h5").read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e["name"] == "thread_name"}
    turns = [
        (e["tid"], e["name"], e["ts"], e["args"]["die"])
        for e in trace
        if e["ph"] == "X" and e["tid"] in (tracks["pool rank 5"], tracks["pool rank 6"])
    ]
    assert turns == [
        (tracks[f"pool rank {rank}"], f"TE {te}", round(taken * 1e6, 3), die)
        for te, rank, die, taken in zip(
            *(_column(pool, k) for k in ("te", "rank", "die", "taken_s")), strict=True
        )
    ]
    assert turns[0][2] + next(e["dur"] for e in trace if e["name"] == "TE 1") == round(
        given_back[0] * 1e6, 3
    )
    # the report draws the pool's figure from the run file
    run_file.close()
    index = write_report([tmp_path / "pool.h5"], tmp_path / "report")
    assert "<h2>pool</h2>" in index.read_text()


def test_a_pool_as_large_as_its_tes_dies_serves_as_fixed_standby_tes(tmp_path):
    """With 3 pool ranks (the pool TEs' 1 + 2 dies) no scale-out waits for ranks, so the run is
    the one with the same TEs standby and launched whole (8 ranks either way): the virtual
    columns, each request's TE and routing time, bit-identical."""
    _, pooled, pooled_file = _run(tmp_path, "dram", pool=3, name="pool3")
    fixed_groups = POOL_TES.replace("PATH", "dram").replace(" pool: true,", "")
    _, fixed, fixed_file = _run(tmp_path, "dram", fixed_groups, pool=0, name="fixed")
    assert pooled.returncode == 0 and fixed.returncode == 0, _ok(pooled) + _ok(fixed)
    assert check_line(pooled) == check_line(fixed) == "check: 72 requests, 864 tokens, 0 mismatches"
    assert pooled_file.attrs["world_size"] == fixed_file.attrs["world_size"] == 8
    assert pooled_file["summary"].attrs["pool_waits"] == 0
    for key in ("te", "routed_s"):
        assert np.array_equal(pooled_file[f"cluster/{key}"][()], fixed_file[f"cluster/{key}"][()])
    for key in pooled_file["virtual"]:
        assert np.array_equal(
            pooled_file[f"virtual/{key}"][()], fixed_file[f"virtual/{key}"][()], equal_nan=True
        ), key
    assert list(pooled_file["cluster/pool/te"][()]) == [1, 2, 2, 2, 2]  # TE 2 formed twice
    # TE 2's own file: each turn's under turn<i>/ (its scale event, its world ranks), the last
    # at the root; together the turns' requests are those TE 2 served
    own = pooled_file["cluster/te2"]
    turns = [own[f"turn{i}"] for i in range(2)]
    assert sorted(k for k in own if k.startswith("turn")) == ["turn0", "turn1"]
    scaling = pooled_file["cluster/scaling"]
    outs = [
        i
        for i, (k, t) in enumerate(zip(scaling["kind"][()], scaling["te"][()]))
        if k == b"out" and t == 2
    ]
    assert [t.attrs["scale_event"] for t in turns] == outs
    assert [list(t.attrs["world_ranks"]) for t in turns] == [[4, 6, 7]] * 2
    served = [set(t["virtual/req_id"][()]) for t in turns]
    te = pooled_file["cluster/te"][()]
    assert served[0].isdisjoint(served[1]) and served[0] and served[1]
    assert served[0] | served[1] == set(pooled_file["cluster/req_id"][()][te == 2])
    assert set(own["virtual/req_id"][()]) == served[1]


def test_the_pool_saves_ranks_against_fixed_standby_tes():
    """The same TEs standby and launched whole: 1 + 2 + 3 ranks and the JE, against 1 + 1 + 1
    TE-shells' and dies' ranks, 2 pool ranks and the JE."""
    sets = [POOL_TES.replace("PATH", "dram"), *SETS]
    pooled = DeploymentPlan.build(
        load_config("configs/colocated.yaml", [*sets, "cluster.pool=2"]), None
    )
    fixed_sets = [s.replace(" pool: true,", "") for s in sets]
    fixed = DeploymentPlan.build(load_config("configs/colocated.yaml", fixed_sets), None)
    assert (pooled.cluster.world_size, fixed.cluster.world_size) == (7, 8)


PAIR = (
    "pd.enabled=true, deployment.num_host_ranks=2, deployment.num_prefill_dies=1, "
    "deployment.dp_groups_per_domain=1, xccl.p2p_pairs=prefill_to_decode, "
    "xccl.ring_slots=8, xccl.slot_bytes=16384"
)


def test_a_pool_pd_pair_s_ranks_then_serve_a_colocated_te(tmp_path):
    """A serving PD pair, a pool PD pair (its JE and decode TE-shell launched; its prefill and
    decode die from the pool) and a 2-die pool colocated TE share 2 pool ranks (10 ranks): the
    first burst forms the pair on ranks 8 and 9, its drain gives them back, the second burst
    forms the colocated TE on them."""
    groups = (
        f"cluster.groups=[{{count: 1, name: pair, set: [{PAIR}]}}, "
        f"{{count: 1, standby: true, pool: true, name: pool-pair, set: [{PAIR}]}}, "
        "{count: 1, standby: true, pool: true, name: pool-colocated, "
        "set: [deployment.dp_groups_per_domain=2]}]"
    )
    lines, result, run_file = _run(tmp_path, "dram", groups)
    assert_all_checked(result, lines)
    assert run_file.attrs["world_size"] == 10
    pool = run_file["cluster/pool"]
    rows = list(zip(*(_column(pool, k) for k in ("te", "rank", "die")), strict=True))
    # the pair's dies (ranks 2 and 3 inside it, after its JE and decode TE-shell); the TE's 1, 2
    assert rows == [(1, 8, 2), (1, 9, 3), (2, 8, 1), (2, 9, 2)]
    assert pool["given_back_s"][1] <= pool["taken_s"][2]
    te, die_rank = run_file["cluster/te"][()], run_file["requests/die_rank"][()]
    # a pair's request ends on the same rank inside it, the serving pair's (world ranks 1..4)
    assert set(die_rank[te == 0]) == {1 + 2}
    assert (te == 1).sum() > 0 and set(die_rank[te == 1]) == {8}
    assert (te == 2).sum() > 0 and set(die_rank[te == 2]) == {8, 9}
    assert [k.decode() for k in run_file["cluster/te_kind"][()]] == ["pd", "pd", "colocated"]


def test_a_pool_te_is_an_npu_fork_source_and_released_once_its_readers_loaded(tmp_path):
    """A serving TE of 1 die and three 1-die pool TEs on 3 pool ranks: TE 1 loads from DRAM,
    TEs 2 and 3 by NPU-fork. TE 2 forks from pool TE 1 (the least loaded, newest TE of its
    shape), TE 3 from pool TE 2 twice (a chain through pool dies' world slots); TE 2's drain
    releases its rank once both of TE 3's loads are in. Every request served checks."""
    groups = (
        "cluster.groups=[{count: 1}, "
        "{count: 1, standby: true, pool: true, name: dram, set: [scaling.path=dram]}, "
        "{count: 2, standby: true, pool: true, name: fork, set: [scaling.path=fork]}]"
    )
    lines, result, run_file = _run(tmp_path, "dram", groups, pool=3, name="source")
    assert_all_checked(result, lines)
    scaling = run_file["cluster/scaling"]
    events = list(
        zip(*(_column(scaling, k) for k in ("kind", "te", "load_path", "load_source_te")))
    )
    assert events == [
        ("out", 1, "dram", -1),
        ("out", 2, "fork", 1),
        ("out", 3, "fork", 2),
        ("in", 3, "", -1),
        ("out", 3, "fork", 2),
        ("in", 3, "", -1),
        ("in", 2, "", -1),
    ], events
    assert list(scaling["load_bytes"][()][[0, 1, 2, 4]]) == [8152192] * 4
    pool = run_file["cluster/pool"]
    rows = list(zip(*(_column(pool, k) for k in ("te", "rank", "die")), strict=True))
    assert rows == [(1, 6, 1), (2, 7, 1), (3, 8, 1), (3, 8, 1)]
    assert pool["given_back_s"][1] == scaling["decided_s"][6]  # TE 2 drained idle: at once
    te, die_rank = run_file["cluster/te"][()], run_file["requests/die_rank"][()]
    for k, rank in ((1, 6), (2, 7), (3, 8)):
        assert (te == k).sum() > 0 and set(die_rank[te == k]) == {rank}


def test_a_lost_pool_te_s_ranks_leave_the_pool(tmp_path):
    """TE 1 (its die on pool rank 5) lost at 6.0 s virtual (`cluster.te_losses`: its server):
    rank 5 stands for its dead die, so it never goes back to the pool; the 2-die TE 2 then
    never fits the one rank left and waits through both bursts; TE 0 serves every request again
    (the lost TE's routed again once found), `--check` 0 mismatches. The run ends cleanly: the
    lost TE's processes run on until the job's end, as any lost TE's do."""
    lines, result, run_file = _run(
        tmp_path, "dram", "cluster.te_losses=[{te: 1, at_s: 6.0}]", "run.trace=true"
    )
    assert_all_checked(result, lines)
    assert _column(run_file["cluster/scaling"], "te") == [1]  # no scale-out of TE 2
    pool = run_file["cluster/pool"]
    rows = list(zip(*(_column(pool, k) for k in ("te", "rank", "given_back_s", "lost_s"))))
    assert rows == [(1, 5, np.inf, 6.0)]
    assert (pool.attrs["lost"], run_file["summary"].attrs["pool_lost"]) == (1, 1)
    assert pool.attrs["waits"] > 0
    assert set(run_file["cluster/te"][()]) == {0}
    trace = json.loads(trace_path(tmp_path / "pool.h5").read_text())["traceEvents"]
    track = next(e["tid"] for e in trace if e.get("args", {}).get("name") == "pool rank 5")
    on_rank = [(e["ph"], e["name"], e["ts"]) for e in trace if e.get("tid") == track and "ts" in e]
    assert ("i", "TE 1 lost", 6e6) in on_rank
    assert ("X", "TE 1", 3.3125e6) in on_rank
