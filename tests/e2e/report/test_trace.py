"""The run's trace (xds_mpi/report/trace.py, xds_mpi/report/trace_writer.py): the API on its own,
then real runs' traces read back and checked against their run files."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT

from xccl.vclock import VirtualClock
from xds_mpi.report import trace
from xds_mpi.report.runfile import read_run_file
from xds_mpi.report.trace_writer import ROLLED_BACK_TID, VIRTUAL_PID, WALL_PID, chrome_trace

XDS_MPI = Path(sys.executable).parent / "xds-mpi"
ROUNDING_US = 0.01  # the writer rounds ts and dur to 1 ns each


@pytest.fixture(autouse=True)
def tracing_off_after():
    yield
    trace.configure(enabled=False)


def test_off_records_nothing():
    trace.configure(enabled=False)
    with trace.span("dispatch", layer=1):
        trace.instant("fault")
        trace.flow_start(7)
    assert trace.take_events() == []


def test_a_span_record_crosses_pickle_with_every_field():
    """Dies send their events pickled (ranks/core/trace_io.py); SpanRecord pickles its values
    in field order, so a field left out of that order comes back as its default."""
    record = trace.SpanRecord(
        name="dispatch", phase="s", wall_start_us=1.5, wall_end_us=2.5, vstart_us=3.5,
        vend_us=None, args={"layer": 2}, flow_id=7, rolled_back=True,
    )  # fmt: skip
    values = record.__reduce__()[1]
    assert len(values) == len(dataclasses.fields(trace.SpanRecord))
    assert pickle.loads(pickle.dumps(record)) == record
    assert pickle.loads(pickle.dumps([record, record])) == [record, record]


def test_spans_carry_both_clocks_and_rolled_back_attempts_are_flagged():
    clock = VirtualClock()
    trace.configure(enabled=True, clock=clock)
    with trace.span("iteration", iteration=0):
        trace.begin_attempt()
        with trace.span("dispatch", layer=1):
            clock.advance(2_000)  # 2 us
        trace.mark_rolled_back()
        clock.restore(0.0)
        with trace.span("combine", layer=1):
            clock.advance(500)
    dispatch, combine, iteration = trace.take_events()
    assert (dispatch.name, dispatch.vstart_us, dispatch.vend_us) == ("dispatch", 0.0, 2.0)
    assert dispatch.rolled_back and not combine.rolled_back
    assert (combine.vstart_us, combine.vend_us) == (0.0, 0.5)
    assert (iteration.vstart_us, iteration.vend_us) == (0.0, 0.5)
    assert iteration.wall_start_us <= dispatch.wall_start_us <= dispatch.wall_end_us
    assert combine.wall_end_us <= iteration.wall_end_us
    document = chrome_trace({1: [dispatch, combine, iteration]}, {1: "rank 1 colocated die 0"})
    spans = [e for e in document["traceEvents"] if e["ph"] == "X" and e["pid"] == VIRTUAL_PID]
    virtual = {e["name"]: e["tid"] for e in spans}
    assert virtual == {"dispatch": ROLLED_BACK_TID + 1, "combine": 1, "iteration": 1}


def test_a_flow_is_drawn_on_the_virtual_clock_only_when_both_ends_have_one():
    trace.configure(enabled=True)  # the TE-shell: no virtual clock
    trace.flow_start(3, "request")
    shell = trace.take_events()
    trace.configure(enabled=True, clock=VirtualClock())
    trace.flow_end(3, "request")
    die = trace.take_events()
    events = chrome_trace({0: shell, 1: die}, {0: "rank 0 host", 1: "rank 1"})["traceEvents"]
    flows = [(e["pid"], e["ph"]) for e in events if e["ph"] in "sf"]
    assert flows == [(WALL_PID, "s"), (WALL_PID, "f")]


# -- real runs ------------------------------------------------------------------------------------
def run_job(tmp_path: Path, name: str, config: str, *sets: str) -> Path:
    args = [str(XDS_MPI), "run", config, "--set", f"run.output_dir={tmp_path}"]
    for text in (f"run.name={name}", *sets):
        args += ["--set", text]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp_path / f"{name}.h5"


@pytest.fixture(scope="module")
def faulted_mtp_run(tmp_path_factory) -> Path:
    """2 colocated dies, MTP depth 1, one injected combine fault (a rollback, a recompute)."""
    return run_job(
        tmp_path_factory.mktemp("trace"),
        "mtp_fault",
        "colocated",
        "deployment.dp_groups_per_domain=2",
        "scheduler.mtp_depth=1",
        "workload.num_requests=4",
        "workload.output_len=8",
        "faults.table=[{die: 1, op: combine, layer: 2, iteration: 3}]",
    )


def load_trace(run_path: Path) -> list[dict]:
    return json.loads(run_path.with_name(f"{run_path.stem}.trace.json").read_text())["traceEvents"]


def check_structure(events: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """Every event on a named track with a known name, durations >= 0, spans nested per track;
    returns the spans by (clock, track)."""
    tracks = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    by_track: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] == "M":
            continue
        assert (e["pid"], e["tid"]) in tracks, e
        assert e["name"] in trace.SPAN_NAMES, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            by_track[e["pid"], e["tid"]].append(e)
    for key, spans in by_track.items():
        open_ends: list[float] = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + ROUNDING_US:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + ROUNDING_US, f"{key}: {e} overlaps"
            open_ends.append(end)
    return by_track


def test_the_trace_of_a_faulted_mtp_run_matches_its_run_file(faulted_mtp_run):
    events = load_trace(faulted_mtp_run)
    by_track = check_structure(events)
    record = read_run_file(faulted_mtp_run)
    model = record.config.model
    num_moe_calls = model.num_layers - model.num_dense_layers + 1  # + the MTP block
    with h5py.File(faulted_mtp_run) as f:
        summary = dict(f["summary"].attrs)
        dies = {int(r): {k: g[k][()] for k in g} for r, g in f["dies"].items()}
    assert summary["rollbacks"] == 1
    for rank, die in dies.items():
        for pid in (WALL_PID, VIRTUAL_PID):  # both clocks, every iteration of the run file
            kept = [e for e in by_track[pid, rank] if not e.get("args", {}).get("rolled_back")]
            names = Counter(e["name"] for e in kept)
            assert names["iteration"] == len(die["num_rows"]), (pid, rank)
            assert names["dispatch"] == names["combine"] == num_moe_calls * len(die["num_rows"])
            assert names["MTP"] == len(die["num_rows"])
        virtual = [e["dur"] for e in by_track[VIRTUAL_PID, rank] if e["name"] == "iteration"]
        # each iteration spans its priced time, but the one rolled back: the failed attempt and
        # the rollback stay on the clock (summary vtime_lost_s, every die alike)
        extra = np.array(virtual) - die["vtime_s"] * 1e6
        assert np.count_nonzero(np.abs(extra) > 1e-2) == 1, extra
        assert extra.sum() == pytest.approx(summary["vtime_lost_s"] * 1e6, rel=1e-6, abs=1e-2)
        rolled_back = by_track[VIRTUAL_PID, ROLLED_BACK_TID + rank]
        assert Counter(e["name"] for e in rolled_back)["rollback"] == 1
    wall = [e for e in events if e["pid"] == WALL_PID]
    assert sum(e["name"] == "recompute" for e in wall) == len(dies)  # one re-run on each die
    assert sum(e["name"] == "fault" for e in wall) == summary["faults_injected"] == 1
    requests = [e for e in wall if e["name"] == "request" and e["ph"] == "X" and e["tid"] == 0]
    assert len(requests) == summary["num_served"]
    starts = {e["id"] for e in wall if e["ph"] == "s"}
    ends = {e["id"] for e in wall if e["ph"] == "f"}
    assert starts == ends and len(starts) == summary["num_served"]


@pytest.mark.long
def test_an_afd_run_traces_attention_and_expert_dies(tmp_path):
    run_path = run_job(tmp_path, "afd", "afd", "workload.num_requests=4", "workload.output_len=4")
    by_track = check_structure(load_trace(run_path))
    record = read_run_file(run_path)
    roles = dict(zip(record.ranks["rank"].tolist(), record.ranks["role"].tolist()))
    for rank, role in roles.items():
        names = {e["name"] for e in by_track[WALL_PID, rank]}
        if role == "attention":
            assert {"iteration", "attention", "gate", "dispatch", "combine", "e2a wait"} <= names
        elif role == "expert":
            assert {"iteration", "expert loop", "experts"} <= names
            assert by_track[VIRTUAL_PID, rank], f"expert rank {rank}: no virtual-clock spans"


def test_the_switch_turns_the_trace_off(tmp_path):
    run_path = run_job(
        tmp_path,
        "trace_off",
        "colocated",
        "run.trace=false",
        "deployment.dp_groups_per_domain=2",
        "workload.num_requests=2",
        "workload.output_len=2",
    )
    assert run_path.exists()
    assert not run_path.with_name("trace_off.trace.json").exists()
