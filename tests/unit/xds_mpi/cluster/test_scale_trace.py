"""The cluster JE's trace (xds_mpi/cluster/scale_trace.py) of crafted scale events, known
answers: a scale-out's span from its decision until its TE serves with its steps inside it one
after another, a TE's serving spans between its scale-out and its drain, the drain's span until
its last finish, a lost TE's serving cut at its loss, a pool rank's turns on its own track;
microseconds on the virtual clock."""

from __future__ import annotations

from xds_mpi.cluster.autoscaler import ScaleEvent
from xds_mpi.cluster.pool import PoolRow, PoolTurn, pool_rows
from xds_mpi.cluster.scale_trace import cluster_trace

OUT = ScaleEvent(
    kind="out",
    te=1,
    decided_s=2.0,
    serves_s=3.5,
    load=4.0,
    steps=(("TE-Load", 1.0), ("Scaler-Post", 0.5)),
    path="dram",
    source_te=0,
    fallback_from="fork",
    fallback_s=0.7,
)
IN = ScaleEvent(kind="in", te=1, decided_s=6.0, serves_s=float("inf"), load=0.2)


def spans(document) -> list[tuple]:
    return [
        (e["tid"], e["name"], e["ts"], e["dur"]) for e in document["traceEvents"] if e["ph"] == "X"
    ]


def test_a_scale_out_and_a_drain_on_the_virtual_clock():
    doc = cluster_trace(
        ["TE 0 (a)", "TE 1 (b)", "TE 2 (b)"],
        [OUT, IN],
        end_s=9.0,
        lost_at={2: 8.0},
        standby={1},
        drained_at={1: 7.25},
    )
    assert spans(doc) == [
        (0, "scale-out TE 1", 2e6, 1.5e6),
        (0, "TE-Load", 2e6, 1e6),
        (0, "Scaler-Post", 3e6, 0.5e6),
        (2, "serving", 3.5e6, 2.5e6),
        (2, "draining", 6e6, 1.25e6),
        (1, "serving", 0.0, 9e6),
        (3, "serving", 0.0, 8e6),  # lost at 8 s
    ]
    out = next(e for e in doc["traceEvents"] if e["name"] == "scale-out TE 1")
    assert out["args"] == {
        "te": 1,
        "path": "dram",
        "source_te": 0,
        "load": 4.0,
        "fallback_from": "fork",
        "fallback_s": 0.7,
    }
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "autoscaler", 1: "TE 0 (a)", 2: "TE 1 (b)", 3: "TE 2 (b)"}
    (lost,) = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert (lost["name"], lost["tid"], lost["ts"]) == ("TE 2 lost", 3, 8e6)


def test_a_pool_rank_s_track_has_a_span_per_te_turn():
    """Rank 5 serves TE 1 (its die 1) and, given back at 6.5 s, TE 2 (its die 1) to the run's
    end; rank 6 only TE 2 (its die 2); rank 7 never: a track without spans."""
    pool = [
        PoolRow(te=1, rank=5, die=1, taken_s=2.0, given_back_s=6.5),
        PoolRow(te=2, rank=5, die=1, taken_s=7.0, given_back_s=float("inf")),
        PoolRow(te=2, rank=6, die=2, taken_s=7.0, given_back_s=float("inf")),
    ]
    doc = cluster_trace(
        ["TE 0 (a)", "TE 1 (b)", "TE 2 (c)"],
        [],
        end_s=9.0,
        lost_at={},
        standby={1, 2},
        drained_at={},
        pool_ranks=(5, 6, 7),
        pool=pool,
    )
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert [names[tid] for tid in (4, 5, 6)] == ["pool rank 5", "pool rank 6", "pool rank 7"]
    assert spans(doc)[1:] == [
        (4, "TE 1", 2e6, 4.5e6),
        (4, "TE 2", 7e6, 2e6),
        (5, "TE 2", 7e6, 2e6),
    ]
    turns = [e["args"] for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] >= 4]
    assert turns == [{"te": 1, "die": 1}, {"te": 2, "die": 1}, {"te": 2, "die": 2}]


def test_the_pool_s_rows_name_each_rank_s_place_inside_its_te():
    turns = [
        PoolTurn(te=1, ranks=(8, 9), taken_s=3.5, given_back_s=8.0),
        PoolTurn(te=2, ranks=(8, 9), taken_s=12.5),
    ]
    rows = pool_rows(turns, {1: 2, 2: 1})  # TE 1: a PD pair (JE, decode TE-shell launched)
    assert [(r.te, r.rank, r.die, r.taken_s, r.given_back_s) for r in rows] == [
        (1, 8, 2, 3.5, 8.0),
        (1, 9, 3, 3.5, 8.0),
        (2, 8, 1, 12.5, float("inf")),
        (2, 9, 2, 12.5, float("inf")),
    ]
