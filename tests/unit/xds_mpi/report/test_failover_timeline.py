"""The report's failover timeline: a failure the detector judged shows its fault, detection and
fence, then the verdict and rebuild until the dies serve again (FailureRecord.resumed_wall_s);
a run file written before that field reads with its default; a served run's capped trace says
how many transient faults it no longer shows."""

from __future__ import annotations

import h5py
import matplotlib.figure
import numpy as np
import pytest

from xds_mpi.report.data import load_run
from xds_mpi.report.plots import recovery
from xds_mpi.results.failures import FailureRecord, read_failures, with_resumed, write_failures

DEAD = FailureRecord(
    kind="dead",
    die=2,
    role="colocated",
    injected_iteration=300,
    injected_wall_s=41.5,
    injected_virtual_s=39.125,
    detected_wall_s=44.0,
    detected_virtual_s=39.25,
    detected_by="heartbeat",
    verdict="dead",
    recovery="vertical scaling: 4 -> 3 decode dies",
)
FLAP = FailureRecord(
    kind="stuck",
    die=3,
    role="colocated",
    injected_iteration=12,
    injected_wall_s=3.0,
    injected_virtual_s=1.5,
)


def _run_file(path, records, **summary):
    with h5py.File(path, "w") as f:
        f.attrs["wall_time_s"] = 60.0
        requests = f.create_group("requests")
        for name in ("ttft_s", "tpot_s", "die_rank"):
            requests[name] = np.zeros(2)
        f.create_group("summary").attrs.update({"serving_clock": "wall", **summary})
        write_failures(f, records)
    return path


@pytest.fixture
def drawn(monkeypatch):
    """The text of every figure saved."""
    texts: list[str] = []
    save = matplotlib.figure.Figure.savefig

    def keep_text(fig, *args, **kwargs):
        for ax in fig.axes:
            texts.extend([ax.get_title(), *(t.get_text() for t in ax.texts)])
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_text)
    return texts


def test_resumed_goes_to_the_judged_dies_only():
    # die 2 judged, resumed 48.25 s; die 3 never detected (a flap): unchanged
    dead, flap = with_resumed([DEAD, FLAP], {2: 48.25, 3: 10.0})
    assert (dead.resumed_wall_s, flap.resumed_wall_s) == (48.25, -1.0)


def test_the_timeline_shows_detection_fence_and_rebuild(tmp_path, drawn):
    records = with_resumed([DEAD, FLAP], {2: 48.25})
    run = load_run(_run_file(tmp_path / "served.h5", records))
    assert run.failures[0]["resumed_wall_s"] == 48.25
    recovery(run, tmp_path / "recovery.png")
    text = " | ".join(drawn)
    assert "+2.50 s detected, fenced; +4.25 s verdict, rebuild, serving again" in text
    assert text.count("detected, fenced") == 1  # the flap was never detected


def test_an_older_run_file_reads_without_the_rebuild(tmp_path, drawn):
    path = _run_file(tmp_path / "old.h5", [DEAD])
    with h5py.File(path, "a") as f:
        del f["failures/resumed_wall_s"]
    with h5py.File(path, "r") as f:
        assert read_failures(f)[0].resumed_wall_s == -1.0
    recovery(load_run(path), tmp_path / "recovery.png")
    assert "+2.50 s detected, fenced | " in " | ".join(drawn) + " | "


def test_a_capped_trace_says_how_many_faults_it_no_longer_shows(tmp_path, drawn):
    path = _run_file(tmp_path / "capped.h5", [DEAD], faults_injected=31)
    path.with_suffix(".trace.json").write_text(
        '{"traceEvents": [{"name": "serve", "pid": 1, "tid": 0, "ts": 0, "ph": "X", "dur": 1},'
        ' {"name": "fault", "pid": 1, "tid": 1, "ts": 5000000, "ph": "i"}]}'
    )
    run = load_run(path)
    recovery(run, tmp_path / "recovery.png")
    assert "1 transient faults shown, 31 injected (trace capped)" in " | ".join(drawn)
