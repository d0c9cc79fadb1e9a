"""The report's recovery panel reads every failure record of a run file (/failures) and puts it
on its timeline: a run through a dead die no longer reads "0 faults ... no faults", and the
latency plots say which clock they are on."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from xds_mpi.report.data import load_run
from xds_mpi.report.plots import failure_rows, latencies, recovery
from xds_mpi.results.failures import FailureRecord, write_failures

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
    requests_affected=(7, 9, 11),
    tokens_per_s_before=310.0,
    tokens_per_s_after=240.0,
)
STUCK = FailureRecord(
    kind="stuck",
    die=3,
    role="colocated",
    injected_iteration=12,
    injected_wall_s=3.0,
    injected_virtual_s=1.5,
)


@pytest.fixture
def run_file(tmp_path):
    """A served run's file as the TE-shell writes it, with two failure records and no trace."""
    path = tmp_path / "served.h5"
    with h5py.File(path, "w") as f:
        f.attrs["wall_time_s"] = 60.0
        requests = f.create_group("requests")
        requests["ttft_s"] = np.array([0.05, 0.07, 0.2])
        requests["tpot_s"] = np.array([0.03, 0.035, 0.04])
        requests["die_rank"] = np.array([1, 2, 3])
        f.create_group("summary").attrs["serving_clock"] = "wall"
        write_failures(f, [DEAD, STUCK])
    return path


def test_every_failure_record_is_on_the_timeline(run_file, tmp_path):
    run = load_run(run_file)
    assert [(f["kind"], f["die"]) for f in run.failures] == [("dead", 2), ("stuck", 3)]
    rows = failure_rows(run)
    label, text, injected, detected = rows[0]
    assert label == "dead colocated die 2"
    assert (injected, detected) == (41.5, 44.0)
    detected_text = "detected 2.50 s later by heartbeat (dead; virtual 39.125 -> 39.250 s)"
    assert f"iteration 300: {detected_text}" in text
    assert "vertical scaling: 4 -> 3 decode dies; 3 requests moved, 0 lost" in text
    assert "tokens/s 310.0 -> 240.0" in text
    label, text, injected, detected = rows[1]
    assert (label, detected) == ("stuck colocated die 3", -1.0)
    assert "never detected; no recovery" in text
    assert recovery(run, tmp_path / "recovery.png").stat().st_size > 0


def test_the_panel_says_what_it_shows(run_file, tmp_path, monkeypatch):
    """The titles and axis labels as drawn: the failure count (not "0 faults"), and the clock
    of every latency axis."""
    drawn: list[str] = []
    import matplotlib.figure

    save = matplotlib.figure.Figure.savefig

    def keep_text(fig, *args, **kwargs):
        for ax in fig.axes:
            drawn.extend([ax.get_title(), ax.get_xlabel(), *(t.get_text() for t in ax.texts)])
        drawn.append(fig._suptitle.get_text() if fig._suptitle else "")
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_text)
    run = load_run(run_file)
    recovery(run, tmp_path / "recovery.png")
    text = " | ".join(drawn)
    assert "served: 2 failures (x injected, | detected and fenced), 0 transient faults" in text
    assert "no failures, faults" not in text
    assert "wall s since serving started" in text
    drawn.clear()
    latencies(run, tmp_path / "latency.png")
    text = " | ".join(drawn)
    assert text.count("TTFT distribution, wall clock") == 1 and "wall ms" in text
    assert "serving driven by the wall clock" in text


def test_a_run_without_failures_says_so(tmp_path):
    path = tmp_path / "clean.h5"
    with h5py.File(path, "w") as f:
        requests = f.create_group("requests")
        for name in ("ttft_s", "tpot_s", "die_rank"):
            requests[name] = np.zeros(1)
    run = load_run(path)
    assert run.failures == [] and failure_rows(run) == []
