"""The run's timeline: spans on every rank, on two clocks (docs/design.md §7).

One tracer per process (= per rank). Code anywhere records with one line, a no-op while tracing
is off (the default until `configure`):

    with trace.span("dispatch", layer=3):   # wall start/end + virtual (910C) start/end
        ...
    trace.instant("fault", op="combine")    # a point in time
    trace.flow_start(flow_id)               # an arrow from here ...
    trace.flow_end(flow_id)                 # ... to here (another rank, same id)

Events are buffered in memory as `SpanRecord`s and sent to the TE-shell once at the end
(ranks/core/trace_io.py), which writes one Chrome trace-event file (xds_mpi/report/trace_writer.py).
The names a span may take are `SPAN_NAMES`: one place, so the writer can check every span.

A rank keeps at most `max_events` events (MAX_EVENTS_ENV; `xds-mpi serve --trace-max-events`,
unbounded when unset): past it the oldest quarter goes, and the first event kept is a "trace cap"
instant saying how many went. A served run's trace is then its newest events, whatever the
number of requests served, instead of a buffer that grows with every iteration until the stop.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Protocol

from xccl.wait_log import WaitLog

# Every span name, and what it covers. Those marked "not emitted yet" wait for their code
# (heartbeats; KV transfers once prefill dies send a trace): one line each emits them.
SPAN_NAMES: dict[str, str] = {
    "iteration": "one decode iteration of a die (all its attempts)",
    "attention": "MLA (prolog + attention) of one layer",
    "gate": "the router of one MoE layer",
    "dispatch": "XCCL dispatch (colocated) or A2E (afd) of one MoE layer",
    "combine": "XCCL combine (colocated) or E2A (afd) of one MoE layer",
    "dispatch wait": "inside dispatch: polling until every peer's record arrived",
    "combine wait": "inside combine: polling until every peer's record arrived",
    "e2a wait": "inside E2A: polling for the trampoline's record",
    "experts": "this die's routed expert slots (and the local shared expert)",
    "sampling": "logits and greedy verification of the sampled rows",
    "MTP": "the MTP modules' drafting passes of one iteration",
    "expert loop": "an expert die's persistent receive / compute / send loop (afd)",
    "rollback": "a failed attempt's state restored (token recomputation)",
    "recompute": "an iteration's re-executed attempt",
    "serve": "the TE-shell serving the workload",
    "check": "the TE-shell re-running the reference",
    "request": "a request dispatched by the TE-shell (instant; flow to its die)",
    "fault": "an injected XCCL fault (instant)",
    "eplb": "EPLB reconfiguration on a die: phases 1-2 (prefetch + disable), each phase-3 load, "
    "phase 4 (enable, instant)",
    "trace cap": "the rank's older events dropped to keep at most max_events (instant: "
    "dropped, max_events)",
    "heartbeat": "a heartbeat (not emitted yet)",
    "kv transfer": "a KV cache transfer, prefill to decode (not emitted yet)",
}


# The most events a rank keeps (a positive integer; unset or 0: every event). `xds-mpi serve`
# sets it for its ranks (launch/serve/command.py); the launcher hands its environment down.
MAX_EVENTS_ENV = "XDS_TRACE_MAX_EVENTS"


class Clock(Protocol):
    now_ns: float


@dataclass(kw_only=True, slots=True)  # not frozen: a frozen one's __init__ sets each field
class SpanRecord:  # through object.__setattr__ (3.8 against 1.4 us, ~35 records a die-iteration)
    """One event, not changed once recorded. wall_*: microseconds since the epoch
    (time.time() base, perf_counter resolution); v*_us: the rank's virtual clock (None on a rank
    without one). phase: "X" span, "i" instant, "s"/"f" flow start/end (flow_id set).
    rolled_back: recorded during an attempt that was rolled back (its virtual times repeat the
    re-run's)."""

    name: str
    phase: str
    wall_start_us: float
    wall_end_us: float
    vstart_us: float | None
    vend_us: float | None
    args: dict
    flow_id: int = -1
    rolled_back: bool = False

    def __reduce__(self):
        """Pickled as its values in field order: a die's events reach the TE-shell at the stop
        in about a third of the time the generic reduction of a slotted class takes."""
        return _span_record, (
            self.name, self.phase, self.wall_start_us, self.wall_end_us, self.vstart_us,
            self.vend_us, self.args, self.flow_id, self.rolled_back,
        )  # fmt: skip


def _span_record(
    name, phase, wall_start_us, wall_end_us, vstart_us, vend_us, args, flow_id, rolled_back
) -> SpanRecord:
    return SpanRecord(
        name=name, phase=phase, wall_start_us=wall_start_us, wall_end_us=wall_end_us,
        vstart_us=vstart_us, vend_us=vend_us, args=args, flow_id=flow_id, rolled_back=rolled_back,
    )  # fmt: skip


class Tracer:
    """max_events: the most events kept (0: all); past it `trim` drops the oldest."""

    def __init__(self, clock: Clock | None = None, max_events: int = 0) -> None:
        self.clock = clock
        self.events: list[SpanRecord | tuple] = []  # spans as tuples (`_record`)
        self.attempt_start = 0  # index of the first event of the attempt running now
        self._offset_us = time.time() * 1e6 - time.perf_counter() * 1e6
        self.max_events = max_events
        # the event count past which `trim` runs: never, without a cap (one comparison per span)
        self.trim_above = max_events or float("inf")
        self.num_dropped = 0  # events dropped by `trim` so far

    def trim(self) -> None:
        """Over max_events: drop the oldest events, down to three quarters of it (the list stays
        the same object: the buffers' WaitLogs append to it), and put a "trace cap" instant
        first, saying how many went."""
        events = self.events
        has_note = bool(events) and type(events[0]) is SpanRecord and events[0].name == "trace cap"
        num = len(events) - has_note - self.max_events * 3 // 4
        del events[: has_note + num]  # the previous note too: one note, at the front
        self.num_dropped += num
        self.attempt_start = max(1, self.attempt_start - has_note - num + 1)
        first = _record(events[0]) if events else None
        wall = first.wall_start_us if first is not None else self.now_us()
        vtime = first.vstart_us if first is not None else self.vnow_us()
        args = {"dropped": self.num_dropped, "max_events": self.max_events}
        events.insert(0, _span_record("trace cap", "i", wall, wall, vtime, vtime, args, -1, False))

    def now_us(self) -> float:
        return time.perf_counter() * 1e6 + self._offset_us

    def vnow_us(self) -> float | None:
        return None if self.clock is None else self.clock.now_ns / 1e3

    def span(self, name: str, args: dict) -> _Span:
        return _Span(self, name, args)

    def record(self, name: str, wall_s: tuple[float, float], vtime_ns: tuple, args: dict) -> None:
        """A span timed by someone else: wall_s = perf_counter() at start/end, vtime_ns = the
        virtual clock at start/end. Kept as a tuple (`_Span` too: ~35 spans a die-iteration)
        until `take_events` makes the SpanRecord."""
        offset = self._offset_us
        self.events.append(
            (name, wall_s[0] * 1e6 + offset, wall_s[1] * 1e6 + offset,
             vtime_ns[0] / 1e3, vtime_ns[1] / 1e3, args)
        )  # fmt: skip
        if len(self.events) > self.trim_above:
            self.trim()

    def point(self, name: str, phase: str, args: dict, flow_id: int = -1) -> None:
        wall, vnow = self.now_us(), self.vnow_us()
        self.events.append(
            SpanRecord(
                name=name,
                phase=phase,
                wall_start_us=wall,
                wall_end_us=wall,
                vstart_us=vnow,
                vend_us=vnow,
                args=args,
                flow_id=flow_id,
            )
        )
        if len(self.events) > self.trim_above:
            self.trim()

    def mark_rolled_back(self) -> None:
        """The attempt running now failed: flag its events (their virtual times will repeat)."""
        for i in range(self.attempt_start, len(self.events)):
            self.events[i] = replace(_record(self.events[i]), rolled_back=True)

    def begin_attempt(self) -> None:
        self.attempt_start = len(self.events)


class _Span:
    """`Tracer.span`'s block: a class, not @contextmanager (a generator and two `next` calls
    fewer; every XCCL wait of a die is one)."""

    __slots__ = ("tracer", "name", "args", "wall", "vstart")

    def __init__(self, tracer: Tracer, name: str, args: dict) -> None:
        self.tracer, self.name, self.args = tracer, name, args

    def __enter__(self) -> None:
        self.wall, self.vstart = self.tracer.now_us(), self.tracer.vnow_us()

    def __exit__(self, *exc) -> None:
        tracer = self.tracer
        tracer.events.append(
            (self.name, self.wall, tracer.now_us(), self.vstart, tracer.vnow_us(), self.args)
        )
        if len(tracer.events) > tracer.trim_above:
            tracer.trim()


def _record(event: SpanRecord | tuple) -> SpanRecord:
    """An event as kept (a span's tuple: name, wall start/end, virtual start/end, args)."""
    if type(event) is SpanRecord:
        return event
    name, wall_start, wall_end, vstart, vend, args = event
    return _span_record(name, "X", wall_start, wall_end, vstart, vend, args, -1, False)


_tracer: Tracer | None = None  # None: tracing off


def configure(*, enabled: bool, clock: Clock | None = None, max_events: int | None = None) -> None:
    """Turn tracing on (a fresh buffer) or off for this process; `clock`: the virtual clock;
    `max_events`: the most events kept (None: $XDS_TRACE_MAX_EVENTS, unset: all)."""
    global _tracer
    if max_events is None:
        max_events = max_events_from_env()
    _tracer = Tracer(clock, max_events) if enabled else None


def max_events_from_env() -> int:
    """$XDS_TRACE_MAX_EVENTS as a count (0 when unset); a value that is no count is refused."""
    value = os.environ.get(MAX_EVENTS_ENV, "0")
    if not value.isdigit():
        raise ValueError(f"${MAX_EVENTS_ENV} must be a count of events (0: all), got {value!r}")
    return int(value)


def num_dropped() -> int:
    """Events this rank dropped to stay under its cap (0 when off or uncapped)."""
    return 0 if _tracer is None else _tracer.num_dropped


def set_clock(clock: Clock) -> None:
    """The rank's virtual clock, once built (spans before it have no virtual times)."""
    if _tracer is not None:
        _tracer.clock = clock


def is_enabled() -> bool:
    return _tracer is not None


def wait_log() -> WaitLog | None:
    """Where an XCCL buffer logs its waits for peers into this rank's events (xccl/wait_log.py:
    the same tuples as a span's, appended in place, no call into the tracer), or None while
    tracing is off; a buffer takes it when it is built."""
    return None if _tracer is None else WaitLog(_tracer.events, _tracer._offset_us)


def span(name: str, **args):
    """A context manager recording `name` with wall and virtual start/end; no-op when off."""
    if _tracer is None:
        return nullcontext()
    return _tracer.span(name, args)


def record(name: str, wall_s: tuple[float, float], vtime_ns: tuple[float, float], **args) -> None:
    """A span its caller already timed (xds_mpi/execution/pricing.py Meter: one measurement,
    two uses)."""
    if _tracer is not None:
        _tracer.record(name, wall_s, vtime_ns, args)


def instant(name: str, **args) -> None:
    if _tracer is not None:
        _tracer.point(name, "i", args)


def flow_start(flow_id: int, name: str = "flow", **args) -> None:
    """The tail of an arrow; `flow_end` with the same id (unique in the run) is its head."""
    if _tracer is not None:
        _tracer.point(name, "s", args, flow_id)


def flow_end(flow_id: int, name: str = "flow", **args) -> None:
    if _tracer is not None:
        _tracer.point(name, "f", args, flow_id)


def begin_attempt() -> None:
    """An iteration's attempt starts (ranks/recovery/recompute.py)."""
    if _tracer is not None:
        _tracer.begin_attempt()


def mark_rolled_back() -> None:
    """The attempt started last failed (ranks/recovery/recompute.py)."""
    if _tracer is not None:
        _tracer.mark_rolled_back()


def take_events() -> list[SpanRecord]:
    """This rank's events so far (the buffer empties); [] when off."""
    return as_records(take_kept())


def take_kept() -> list[SpanRecord | tuple]:
    """This rank's events so far as kept, spans as tuples (the buffer empties); [] when off.
    A die sends these at the stop (ranks/core/trace_io.py): tuples pickle and unpickle without
    a call per span, and the TE-shell makes the SpanRecords (`as_records`) when it writes the
    trace, after the summary, instead of ~1,700 calls in the stop of the main job."""
    if _tracer is None:
        return []
    events = _tracer.events[:]  # the list itself stays: the buffers' WaitLogs append to it
    _tracer.events.clear()
    _tracer.attempt_start = 0
    return events


def as_records(events: list[SpanRecord | tuple]) -> list[SpanRecord]:
    """Events as kept (`take_kept`) as SpanRecords."""
    return [_record(e) for e in events]
