"""A rank's trace buffer under a cap (xds_mpi/report/trace.py Tracer.trim): however many
iterations a served run goes through, a rank keeps at most max_events, the newest, with a note
of how many went first; the trace file names every capped rank."""

from __future__ import annotations

import time

import pytest

from xds_mpi.report import trace
from xds_mpi.report.trace_writer import chrome_trace


class Clock:
    now_ns = 5e9


@pytest.fixture
def capped(monkeypatch):
    monkeypatch.setenv(trace.MAX_EVENTS_ENV, "400")
    trace.configure(enabled=True, clock=Clock())
    yield
    trace.configure(enabled=False)


def one_iteration(i: int) -> None:
    """A die's iteration in miniature: spans of each kind the tracer keeps, and a WaitLog's."""
    with trace.span("attention", layer=0, iteration=i):
        pass
    trace.record("iteration", (time.perf_counter(), time.perf_counter()), (1e9, 2e9), iteration=i)
    trace.instant("fault", op="dispatch", iteration=i)
    trace.wait_log().add("dispatch wait", time.perf_counter(), 1e9, 2e9, iteration=i)


def test_a_served_run_keeps_at_most_max_events_whatever_it_served(capped):
    num_iterations = 5_000  # 20,000 events: 50 times the cap
    for i in range(num_iterations):
        one_iteration(i)
        # at most one WaitLog append since the tracer last looked
        assert len(trace._tracer.events) <= 400 + 1
    events = trace.as_records(trace.take_kept())
    assert len(events) <= 401
    note = events[0]
    assert (note.name, note.phase) == ("trace cap", "i")
    assert note.args == {"dropped": trace.num_dropped(), "max_events": 400}
    # nothing lost unsaid: kept (less the note) + dropped = every event recorded
    assert len(events) - 1 + trace.num_dropped() == 4 * num_iterations
    # the newest are the ones kept, in order, the last iteration's last
    iterations = [e.args["iteration"] for e in events[1:]]
    assert iterations == sorted(iterations)
    assert iterations[-1] == num_iterations - 1
    assert events[-1].name == "dispatch wait"


def test_the_trace_file_names_each_capped_rank(capped):
    for i in range(200):
        one_iteration(i)
    capped_events = trace.take_events()
    document = chrome_trace({1: capped_events, 2: []}, {1: "rank 1", 2: "rank 2"})
    assert document["otherData"]["trace_caps"] == {
        "1": {"dropped": trace.num_dropped(), "max_events": 400}
    }
    assert trace.num_dropped() > 0


def test_a_rolled_back_attempt_is_flagged_across_a_trim(capped):
    for i in range(99):
        one_iteration(i)
    trace.begin_attempt()
    for i in range(99, 120):  # 84 events: the trim at 401 events falls inside the attempt
        one_iteration(i)
    trace.mark_rolled_back()
    events = trace.as_records(trace.take_kept())
    assert trace.num_dropped() > 0  # the trim came
    flagged = {e.args["iteration"] for e in events[1:] if e.rolled_back}
    assert flagged == set(range(99, 120))  # the whole attempt, and nothing before it
    assert not events[0].rolled_back


def test_without_a_cap_every_event_stays(monkeypatch):
    monkeypatch.delenv(trace.MAX_EVENTS_ENV, raising=False)
    trace.configure(enabled=True, clock=Clock())
    try:
        for i in range(500):
            one_iteration(i)
        assert len(trace.take_kept()) == 2_000 and trace.num_dropped() == 0
    finally:
        trace.configure(enabled=False)


def test_a_cap_that_is_no_count_is_refused(monkeypatch):
    monkeypatch.setenv(trace.MAX_EVENTS_ENV, "lots")
    with pytest.raises(ValueError, match=r"XDS_TRACE_MAX_EVENTS must be a count.*'lots'"):
        trace.configure(enabled=True)
