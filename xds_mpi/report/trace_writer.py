"""The run's trace file: Chrome trace-event JSON that the Perfetto UI (ui.perfetto.dev) and
chrome://tracing open. Two processes, one per clock, each with one track (thread) per rank:

- pid 1 "wall clock": what MPI on this machine took, microseconds since the run's first event;
- pid 2 "projected 910C clock": each die's virtual clock (xccl/vclock.py), microseconds since
  the die started. The spans of rolled-back attempts go to a track of their own per die
  ("rolled-back attempts"), since the re-run repeats their virtual times.

Flows ("s"/"f", bound to the enclosing slice) draw arrows between ranks on the wall clock, and on
the virtual clock when both ends have one. A rank that kept only its newest events (a cap:
xds_mpi/report/trace.py) is named in `otherData.trace_caps` with the number it dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

from xds_mpi.report.trace import SpanRecord

WALL_PID, VIRTUAL_PID = 1, 2
CLOCK_NAMES = {WALL_PID: "wall clock", VIRTUAL_PID: "projected 910C clock"}
ROLLED_BACK_TID = 100_000  # + rank: a die's rolled-back attempts on the virtual clock


def trace_path(run_path: str | Path) -> Path:
    """<run file stem>.trace.json beside the run file."""
    run_path = Path(run_path)
    return run_path.with_name(f"{run_path.stem}.trace.json")


def chrome_trace(events: dict[int, list[SpanRecord]], track_names: dict[int, str]) -> dict:
    """The trace-event document of every rank's `events`; track_names: rank -> its track name."""
    starts = [e.wall_start_us for evs in events.values() for e in evs]
    t0 = min(starts, default=0.0)
    out = _metadata(events, track_names)
    virtual_flows = _virtual_flows(events)
    for rank, evs in sorted(events.items()):
        for e in evs:
            out.append(_event(e, WALL_PID, rank, e.wall_start_us - t0, e.wall_end_us))
            is_flow = e.phase in ("s", "f")
            if e.vstart_us is not None and (not is_flow or e.flow_id in virtual_flows):
                tid = ROLLED_BACK_TID + rank if e.rolled_back else rank
                out.append(_event(e, VIRTUAL_PID, tid, e.vstart_us, e.vend_us - e.vstart_us))
    other = {"t0_unix_us": t0, "trace_caps": trace_caps(events)}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def trace_caps(events: dict[int, list[SpanRecord]]) -> dict[str, dict]:
    """rank -> {"dropped", "max_events"} of each rank that dropped its oldest events to stay
    under its cap (the "trace cap" instant it keeps first: xds_mpi/report/trace.py)."""
    return {
        str(rank): evs[0].args
        for rank, evs in sorted(events.items())
        if evs and evs[0].name == "trace cap"
    }


def _virtual_flows(events: dict[int, list[SpanRecord]]) -> set[int]:
    """The flows whose both ends have virtual times (a host rank has no virtual clock)."""
    ends: dict[str, set[int]] = {"s": set(), "f": set()}
    for evs in events.values():
        for e in evs:
            if e.phase in ends and e.vstart_us is not None:
                ends[e.phase].add(e.flow_id)
    return ends["s"] & ends["f"]


def _event(e: SpanRecord, pid: int, tid: int, ts: float, end_or_dur: float) -> dict:
    """One trace event; end_or_dur is the wall end (pid 1) or the virtual duration (pid 2)."""
    dur = end_or_dur - e.wall_start_us if pid == WALL_PID else end_or_dur
    event = {"name": e.name, "ph": e.phase, "pid": pid, "tid": tid, "ts": round(ts, 3)}
    if e.phase == "X":
        event["dur"] = round(dur, 3)
    elif e.phase == "i":
        event["s"] = "t"
    else:  # flow: arrows from the slice around "s" to the slice around "f"
        event.update(id=e.flow_id, cat="flow")
        if e.phase == "f":
            event["bp"] = "e"
    if e.args or e.rolled_back:
        event["args"] = {**e.args, "rolled_back": True} if e.rolled_back else e.args
    return event


def _metadata(events: dict[int, list[SpanRecord]], track_names: dict[int, str]) -> list[dict]:
    """Names and order of the two clocks' processes and of every rank's track."""
    meta = []
    for pid, name in CLOCK_NAMES.items():
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
    for rank, name in sorted(track_names.items()):
        for pid in CLOCK_NAMES:
            meta += _thread(pid, rank, name)
        if any(e.rolled_back for e in events.get(rank, ())):
            meta += _thread(VIRTUAL_PID, ROLLED_BACK_TID + rank, f"{name}: rolled-back attempts")
    return meta


def _thread(pid: int, tid: int, name: str) -> list[dict]:
    return [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
        {
            "ph": "M",
            "name": "thread_sort_index",
            "pid": pid,
            "tid": tid,
            "args": {"sort_index": tid},
        },
    ]


def track_names(topo) -> dict[int, str]:
    """rank -> "rank 3 colocated die 2" (host ranks without a die)."""
    return {
        info.rank: f"rank {info.rank} {info.role}" + (f" die {info.die_idx}" if info.is_die else "")
        for info in topo.ranks
    }


def write_trace(path: str | Path, events: dict[int, list[SpanRecord]], topo) -> Path:
    """Write the trace of every rank's `events` to `path` (atomically, like the run file)."""
    path = Path(path)
    document = chrome_trace(events, track_names(topo))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, default=_plain, separators=(",", ":")))
    tmp.replace(path)
    return path


def _plain(value):
    """numpy scalars in span arguments as Python numbers."""
    return value.item() if hasattr(value, "item") else str(value)
