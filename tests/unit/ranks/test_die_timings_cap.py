"""A served die's per-iteration timings stay bounded (`xds-mpi serve --max-iterations`,
ranks/core/die_io.py `Outbox`): past the cap the oldest half goes, the newest are kept in order
and the report counts what went; without the setting every iteration is kept. No MPI."""

from __future__ import annotations

from dataclasses import fields

from ranks.core.die_io import Outbox
from xds_mpi.execution.pricing import IterationTiming
from xds_mpi.results.record_cap import MAX_ITERATIONS_ENV


def _timing(i: int) -> IterationTiming:
    return IterationTiming(**{f.name: 0 for f in fields(IterationTiming)} | {"vtime_s": float(i)})


def _served(n: int) -> Outbox:
    outbox = Outbox(None, 1, timeout_s=1.0)
    for i in range(n):
        outbox.stream([], _timing(i))
    return outbox


def test_past_the_cap_the_oldest_half_goes_and_is_counted(monkeypatch):
    monkeypatch.setenv(MAX_ITERATIONS_ENV, "10")
    outbox = _served(25)
    kept = list(outbox.timings["vtime_s"])
    # at 11 entries the newest 5 stay: after iterations 10, 16 and 22, so 18..24 are kept
    assert kept == [float(i) for i in range(18, 25)]
    assert len(kept) <= 10 and outbox.num_timings_dropped == 25 - len(kept)
    assert all(len(values) == len(kept) for values in outbox.timings.values())
    assert outbox.num_iterations == 25


def test_without_the_setting_every_iteration_is_kept(monkeypatch):
    monkeypatch.delenv(MAX_ITERATIONS_ENV, raising=False)
    outbox = _served(300)
    assert len(outbox.timings["vtime_s"]) == 300 and outbox.num_timings_dropped == 0
