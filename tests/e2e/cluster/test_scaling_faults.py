"""Scale events beside faults (docs/cluster.md "Scaling"), colocated TEs of 1 die (the JE and
2 ranks per TE): a fork source lost mid-fork (cluster.te_losses inside the new TE's TE-Load)
makes the new TE load by autoscaler.fork_fallback (dram: its TE-shell's window; cold: the file),
priced and counted in /cluster/scaling; a fork chain (the second scale-out forks from the TE the
first scaled out, whose dies pulled their own weights first), with the run's trace read back;
a scale-out and a drain while a serving TE fails over a dead die. Each run `--check`s every
request (0 mismatches: nothing lost, the weights right), bounded by the subprocess timeout and
run.timeout_s."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_cluster import AUTOSCALE, assert_all_checked, run_cluster
from test_virtual_time import _jsonl, _sets

SCALER = (
    "cluster.policy=least_load",
    "deployment.dp_groups_per_domain=1",
    *AUTOSCALE,
)


def _burst(tmp_path, num_burst: int = 32) -> tuple[list[dict], list[str]]:
    """1 request/s for 3 s, `num_burst` at 16/s, then 1/s."""
    times = [0.0, 1.0, 2.0] + [3 + i / 16 for i in range(num_burst)] + [6.0, 7.0, 8.0]
    lines = [
        {"prompt_ids": list(range(3 + i % 7, 19 + i % 7)), "max_tokens": 12, "arrival_s": t}
        for i, t in enumerate(times)
    ]
    return lines, _jsonl(tmp_path, lines)


def _groups(num_standby: int, standby_sets: str, serving_sets: str = "") -> str:
    return (
        f"cluster.groups=[{{count: 1, set: [{serving_sets}]}}, "
        f"{{count: {num_standby}, standby: true, set: [{standby_sets}]}}]"
    )


def _scaling(run_file) -> list[dict]:
    """/cluster/scaling as one dict per event."""
    group = run_file["cluster/scaling"]
    keys = [k for k in group if k not in ("step_name", "step_s")]
    rows = [{k: group[k][i] for k in keys} for i in range(len(group["kind"]))]
    for row in rows:
        for k, v in row.items():
            row[k] = v.decode() if isinstance(v, bytes) else v
    return rows


def _all_checked(result, lines) -> None:
    assert_all_checked(result, lines)


@pytest.mark.parametrize("fallback", ["dram", "cold"])
def test_a_fork_source_lost_mid_fork_makes_the_new_te_load_by_the_fallback(tmp_path, fallback):
    """The scale-out is decided at 3.3125 s virtual (the run without a loss: its TE serves from
    3.8125 s, forked from TE 0); TE 0 lost at 3.5 s, inside the fork: TE 1 loads by the fallback
    from then (the fixed scale_out_s again: serving from 4.0 s), TE 0's unfinished requests go
    to TE 1 once the loss is found."""
    lines, workload = _burst(tmp_path)
    sets = _sets(
        *SCALER,
        _groups(1, "scaling.path=fork"),
        "cluster.te_losses=[{te: 0, at_s: 3.5}]",
        f"autoscaler.fork_fallback={fallback}",
    )
    result, run_file = run_cluster(tmp_path, *workload, *sets)
    _all_checked(result, lines)
    (out,) = _scaling(run_file)
    assert (out["kind"], out["te"], out["decided_s"]) == ("out", 1, 3.3125)
    assert (out["load_path"], out["load_fallback_from"], out["load_source_te"]) == (
        fallback,
        "fork",
        0,
    )
    assert out["load_fallback_s"] == pytest.approx(3.5 - 3.3125)  # the fork's time till the loss
    assert out["serves_s"] == pytest.approx(3.5 + 0.5)
    assert run_file["summary"].attrs["rerouted_requests"] > 0  # the premise: TE 0's requests


def test_a_fork_chain_the_second_scale_out_forks_from_a_serving_te_and_the_trace(tmp_path):
    """Two standby fork TEs: the second scale-out's source is a serving TE of its shape, here
    TE 1 (the least loaded: scaled out by the first), whose dies pulled their weights before
    they were read; --check proves both TEs' weights. The JE's trace (run.trace) holds each
    scale-out with its step inside it and each TE's serving spans, on the virtual clock."""
    lines, workload = _burst(tmp_path, num_burst=48)
    sets = _sets(*SCALER, _groups(2, "scaling.path=fork"), "cluster.num_tes=3", "run.trace=true")
    result, run_file = run_cluster(tmp_path, *workload, *sets)
    _all_checked(result, lines)
    outs = [row for row in _scaling(run_file) if row["kind"] == "out"]
    assert [row["te"] for row in outs][:2] == [1, 2], outs
    assert [row["load_path"] for row in outs][:2] == ["fork", "fork"]
    assert outs[0]["load_source_te"] == 0  # the only serving TE then
    assert outs[1]["load_source_te"] in (0, 1)  # either serving TE of its shape
    assert outs[1]["load_source_te"] == 1  # here the chain: TE 1 the least loaded
    te = run_file["cluster/te"][()]
    assert (te == 1).sum() > 0 and (te == 2).sum() > 0  # both scaled-out TEs served

    trace = json.loads((tmp_path / "cluster.trace.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert names == {
        0: "autoscaler",
        1: "TE 0 (colocated)",
        2: "TE 1 (colocated)",
        3: "TE 2 (colocated)",
    }
    spans = [e for e in trace if e["ph"] == "X"]
    scaling = run_file["cluster/scaling"]
    for row in _scaling(run_file):
        if row["kind"] != "out":
            continue
        (span,) = [
            e
            for e in spans
            if e["name"] == f"scale-out TE {row['te']}"
            and e["ts"] == pytest.approx(row["decided_s"] * 1e6)
        ]
        assert span["dur"] == pytest.approx((row["serves_s"] - row["decided_s"]) * 1e6)
        assert span["args"]["source_te"] == row["load_source_te"]
        steps = [e for e in spans if e["tid"] == 0 and e["name"] != span["name"]]
        step = [e for e in steps if e["ts"] == span["ts"]]
        assert [e["name"] for e in step] == [n.decode() for n in scaling["step_name"][()]]
        serving = [e for e in spans if e["tid"] == row["te"] + 1 and e["name"] == "serving"]
        assert any(e["ts"] == pytest.approx(row["serves_s"] * 1e6) for e in serving)
    (te0,) = [e for e in spans if e["tid"] == 1]  # TE 0 serves from 0 to the end: never drained
    assert te0["ts"] == 0 and te0["name"] == "serving"


def test_a_scale_out_while_a_serving_te_fails_over_a_dead_die(tmp_path):
    """TE 0 (2 dies, ring replicas) loses die 2 at its iteration 20 (1.35 s virtual) and fails
    over until ~10 s virtual; the burst scales out to TE 1 (dram) during it. Nothing lost: every
    request served and checked."""
    lines, workload = _burst(tmp_path)
    faulty = (
        "deployment.dp_groups_per_domain=2, 'faults.events=[{kind: dead, die: 2, iteration: "
        "20}]', health.replicas=ring, deployment.redundant_slots_per_die=8"
    )
    sets = _sets(
        *SCALER,
        _groups(1, "scaling.path=dram", serving_sets=faulty),
        "health.timeout_s=4",
        "health.dp_interval_s=0.2",
        "faults.on_timeout=recompute",
        "xccl.poll_timeout_s=1",
    )
    result, run_file = run_cluster(tmp_path, *workload, *sets)
    _all_checked(result, lines)
    output = result.stdout + result.stderr
    fault_s, resume_s = (
        float(x) for x in re.search(r"fault at ([\d.]+) s;.* resume at ([\d.]+) s", output).groups()
    )
    (out,) = [row for row in _scaling(run_file) if row["kind"] == "out"]
    assert fault_s < out["decided_s"] < resume_s  # the premise: scaled out during the failover
    assert out["load_path"] == "dram"
    te = run_file["cluster/te"][()]
    assert (te == 1).sum() > 0 and (te == 0).sum() > 0
    assert np.all(te >= 0)  # every request has its TE
