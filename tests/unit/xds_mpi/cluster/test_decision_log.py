"""The JE's decision log (xds_mpi/cluster/decisions.py) for a few requests routed by `prefix`
through `decide` as the JE routes, written to and read back from a run file's /cluster group,
and the regret estimate (xds_mpi/cluster/regret.py) on a crafted set with known answers."""

from __future__ import annotations

import math
from collections import deque

import h5py
import numpy as np
import pytest

from xds_mpi.cluster.decisions import read_decisions, write_decisions
from xds_mpi.cluster.loads import TeLoads
from xds_mpi.cluster.policies import load_policy
from xds_mpi.cluster.prompt_tree import PromptTree
from xds_mpi.cluster.regret import Served, estimate_jct, regret_summary, regrets, write_regret
from xds_mpi.scheduling.admission import Completions, decide
from xds_mpi.workload.requests import Request

BT = 4


def _req(req_id: int, arrival_s: float, *blocks: int) -> Request:
    """Blocks of BT tokens (block b: b*10..b*10+3) and one more token."""
    prompt = [b * 10 + i for b in blocks for i in range(BT)] + [999]
    return Request(req_id=req_id, prompt=tuple(prompt), max_new_tokens=3, arrival_s=arrival_s)


def _route_prefix() -> TeLoads:
    """Requests 0 and 1 at 0 s (different prompts), 2 at 1 s sharing request 1's first two
    blocks, 3 at 2 s sharing request 0's first block; each finishes 0.5 s after its arrival."""
    reqs = [_req(0, 0.0, 1, 2), _req(1, 0.0, 5, 6, 7), _req(2, 1.0, 5, 6, 8), _req(3, 2.0, 1, 9)]
    tree = PromptTree(2, block_tokens=BT, capacity_blocks=64)
    loads = TeLoads(2, load_policy("prefix"), kinds=["colocated"] * 2, num_dies=[2, 2], tree=tree)
    queue, done, now, after = deque(reqs), Completions(), None, 0.0
    while queue:
        grant = decide(queue, loads, done, now_s=now, after_s=after)
        for d in grant.decisions:
            done.add(d.req.req_id, d.req.arrival_s + 0.5)
            after = d.vtime_s
        now = grant.horizon_s
    return loads


def test_the_decision_log_keeps_each_te_s_state_the_scores_and_the_choice():
    log = _route_prefix().decisions
    assert [(d.req_id, d.decided_s, d.te) for d in log] == [
        (0, 0.0, 0),  # nothing held anywhere: the least load, the lowest index
        (1, 0.0, 1),  # TE 0 busy with request 0
        (2, 1.0, 1),  # 2 blocks of it on TE 1
        (3, 2.0, 0),  # 1 block on TE 0
    ]
    assert [[s.prefix_tokens for s in d.states] for d in log] == [[0, 0], [0, 0], [0, 8], [4, 0]]
    assert [d.scored.scores for d in log] == [(0, 0), (0, 0), (0, 8), (4, 0)]
    assert [[s.num_unfinished for s in d.states] for d in log] == [[0, 0], [1, 0], [0, 0], [0, 0]]
    assert [[s.unfinished_tokens for s in d.states] for d in log][1] == [12, 0]  # 9 + 3
    assert [[s.num_routed for s in d.states] for d in log][3] == [1, 2]
    assert {s.kind for d in log for s in d.states} == {"colocated"}
    assert [d.scored.note for d in log][2] == "prefix 8 tokens"


def test_the_decision_log_round_trips_through_the_run_file(tmp_path):
    log = _route_prefix().decisions
    with h5py.File(tmp_path / "run.h5", "w") as f:
        write_decisions(f.create_group("cluster"), log)
    back = read_decisions(tmp_path / "run.h5")
    assert back["req_id"].tolist() == [0, 1, 2, 3] and back["te"].tolist() == [0, 1, 1, 0]
    assert back["prefix_tokens"].tolist() == [[0, 0], [0, 0], [0, 8], [4, 0]]
    assert back["num_dies"].tolist() == [[2, 2]] * 4
    assert back["score"].tolist() == [[0, 0], [0, 0], [0, 8], [4, 0]]
    assert back["kind"][0].tolist() == ["colocated", "colocated"]
    assert back["note"][3] == "prefix 4 tokens"
    assert back["decided_s"].tolist() == [0.0, 0.0, 1.0, 2.0]


def test_a_policy_without_scores_logs_nan():
    loads = TeLoads(2, load_policy("round_robin"))
    loads.on_dispatch(loads.pick(_req(0, 0.0, 1)), _req(0, 0.0, 1))
    assert all(math.isnan(x) for x in loads.decisions[0].scored.scores)


def _served(req_id, te, routed_s, size, jct_s) -> Served:
    return Served(req_id=req_id, te=te, routed_s=routed_s, size=size, jct_s=jct_s)


def test_the_regret_estimate_on_a_crafted_set():
    """TE 0 gives size-100 requests 1.0 s, TE 1 gives them 0.5 s near t=0..3 and 5.0 s at t=50
    (far in time: not a neighbour). A request on TE 0 would have been 0.5 s on TE 1 (regret
    0.5 s); one on TE 1 is already on its best; a size-300 request on TE 0 (1.0 s) has no
    similar-size neighbour on TE 1, so the 4 nearest in time are scaled by 3: 1.5 s, not better."""
    served = [
        _served(0, 0, 0.0, 100, 1.0),
        _served(1, 1, 0.5, 100, 0.5),
        _served(2, 0, 1.0, 100, 1.0),
        _served(3, 1, 1.5, 100, 0.5),
        _served(4, 1, 2.0, 100, 0.5),
        _served(5, 1, 3.0, 100, 0.5),
        _served(6, 1, 50.0, 100, 5.0),
        _served(7, 0, 2.5, 300, 1.0),
    ]
    assert estimate_jct(served[0], [s for s in served if s.te == 1]) == 0.5
    assert estimate_jct(served[7], [s for s in served if s.te == 1]) == pytest.approx(1.5)
    assert math.isnan(estimate_jct(served[0], []))  # a TE that served nothing
    rows = regrets(served, num_tes=2)
    assert [(r.req_id, r.est_best_te) for r in rows] == [
        (0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 0), (7, 0),
    ]  # fmt: skip
    assert [r.regret_s for r in rows] == pytest.approx([0.5, 0, 0.5, 0, 0, 0, 4.0, 0])
    # request 6 (5.0 s at t=50) would have had ~1.0 s on TE 0, by TE 0's requests scaled 1:1
    assert rows[6].est_best_jct_s == 1.0
    s = regret_summary(rows)
    assert s["regret_requests"] == 8 and s["regret_best_share"] == 5 / 8
    assert s["regret_mean_ms"] == pytest.approx(5000 / 8)
    assert s["regret_p90_ms"] == pytest.approx(np.percentile([500, 0, 500, 0, 0, 0, 4000, 0], 90))


def test_regret_columns_sit_beside_the_logged_requests(tmp_path):
    rows = regrets([_served(0, 0, 0.0, 10, 1.0), _served(1, 1, 0.0, 10, 0.25)], num_tes=2)
    with h5py.File(tmp_path / "run.h5", "w") as f:
        write_regret(f, rows, [1, 9, 0])  # 9: routed, never produced a token
        assert f["est_best_te"][()].tolist() == [1, -1, 1]
        assert f["regret_s"][()][[0, 2]].tolist() == [0.0, 0.75]
        assert math.isnan(f["jct_s"][1])
