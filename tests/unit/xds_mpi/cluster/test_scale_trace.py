"""The cluster JE's trace (xds_mpi/cluster/scale_trace.py) of crafted scale events, known
answers: a scale-out's span from its decision until its TE serves with its steps inside it one
after another, a TE's serving spans between its scale-out and its drain, the drain's span until
its last finish, a lost TE's serving cut at its loss; microseconds on the virtual clock."""

from __future__ import annotations

from xds_mpi.cluster.autoscaler import ScaleEvent
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
