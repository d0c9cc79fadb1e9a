"""A cluster run's trace (run.trace): the JE's view on the virtual clock as Chrome trace-event
JSON beside the run file (xds_mpi/report/trace_writer.py's format and clock process; Perfetto
and chrome://tracing open it):

- one track per TE, "TE k (group)": its serving spans, from 0 or a scale-out's `serves_s` until
  a drain's decision, its loss, or the run's last finish; a draining TE's span "draining" from
  the drain's decision until its last request finished (`standby_s`: the run's end if unknown);
- one track "autoscaler": each scale-out as a span from its decision until its TE serves, with
  its steps (DeepServe's five, or one fixed) as spans inside it, one after another; its args
  name the TE, the TE-Load path and its source, and a fork's fallback;
- with a pool of ranks (docs/cluster.md "A pool of ranks"), one track per pool rank, "pool rank
  r": a span "TE k" per turn, from the scale-out that took the rank until the decision that gave
  it back (the run's last finish if it was not; its TE's loss, an instant, if lost), its args
  the TE and the rank's place inside it.

Microseconds since the virtual 0; the TEs' own traces are not written in a cluster.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from xds_mpi.cluster.pool import PoolRow, pool_rows
from xds_mpi.report.trace_writer import CLOCK_NAMES, VIRTUAL_PID

SCALER_TID = 0  # the autoscaler's track; TE k's is k + 1; the i-th pool rank's after the TEs'


def cluster_trace(
    te_names: list[str],
    events,
    *,
    end_s: float,
    lost_at: dict[int, float],
    standby: set[int],
    drained_at: dict[int, float],
    pool_ranks: tuple[int, ...] = (),
    pool: list[PoolRow] | tuple[PoolRow, ...] = (),
) -> dict:
    """The trace-event document. te_names: per TE its track's name; events: the autoscaler's
    `ScaleEvent`s in decision order; end_s: the run's last finish (virtual s); lost_at: TE ->
    its loss; standby: the TEs that start standby; drained_at: scale-in event index -> when its
    TE's last request finished (the run's end if not in it); pool_ranks: the pool's world ranks,
    pool: their turns (xds_mpi/cluster/pool.py `pool_rows`)."""
    out = _metadata([*te_names, *(f"pool rank {rank}" for rank in pool_ranks)])
    serving_from = {te: 0.0 for te in range(len(te_names)) if te not in standby}
    for index, e in enumerate(events):
        if e.kind == "out":
            out += _scale_out(e)
            serving_from[e.te] = e.serves_s
            continue
        start_s = serving_from.pop(e.te, None)
        if start_s is not None:
            out.append(_span("serving", e.te + 1, start_s, e.decided_s, {}))
        done_s = drained_at.get(index, end_s)
        out.append(_span("draining", e.te + 1, e.decided_s, done_s, {"scale_event": index}))
    for te, start_s in serving_from.items():
        stop_s = min(lost_at.get(te, math.inf), end_s)
        if start_s < stop_s:
            out.append(_span("serving", te + 1, start_s, stop_s, {}))
        if te in lost_at:
            out.append(_instant(f"TE {te} lost", te + 1, lost_at[te]))
    pool_tid = {rank: len(te_names) + 1 + i for i, rank in enumerate(pool_ranks)}
    for row in pool:
        args = {"te": row.te, "die": row.die}
        stop_s = min(row.given_back_s, max(end_s, row.taken_s))
        if not math.isnan(row.lost_s):  # out of the pool for good
            stop_s = row.lost_s
            out.append(_instant(f"TE {row.te} lost", pool_tid[row.rank], row.lost_s))
        out.append(_span(f"TE {row.te}", pool_tid[row.rank], row.taken_s, stop_s, args))
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"clock": "virtual"}}


def trace_of_run(cluster, autoscaler, virtual_times, te_of, routed_s, lost_at) -> dict:
    """`cluster_trace` of a JE's run: cluster, its plan (TeInfo per TE); autoscaler: the JE's
    (None: no scaling); virtual_times: the served requests (xds_mpi/results/virtual.py); te_of,
    routed_s: req_id -> its TE, its routing (virtual s); lost_at: TE -> its loss."""
    events = autoscaler.events if autoscaler is not None else []
    pool = autoscaler.pool if autoscaler is not None else None
    first_die = {t.te: t.num_launched for t in cluster.tes if t.is_pool}
    served = [
        (te_of.get(v.req_id, -1), routed_s.get(v.req_id, 0.0), v.finish_s) for v in virtual_times
    ]
    end_s = max((finish_s for _, _, finish_s in served), default=0.0)
    drained_at = {}
    for index, e in enumerate(events):
        if e.kind == "in":  # its last request routed before the drain finished then
            finishes = [f for te, at, f in served if te == e.te and at <= e.decided_s]
            drained_at[index] = max(finishes, default=e.decided_s)
    return cluster_trace(
        [f"TE {t.te} ({t.group})" for t in cluster.tes],
        events,
        end_s=end_s,
        lost_at=lost_at,
        standby={t.te for t in cluster.tes if t.standby},
        drained_at=drained_at,
        pool_ranks=cluster.pool_ranks if pool is not None else (),
        pool=pool_rows(pool.turns, first_die) if pool is not None else (),
    )


def write_cluster_trace(path: str | Path, document: dict) -> Path:
    """Write `document` to `path` atomically (like the run file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, separators=(",", ":")))
    tmp.replace(path)
    return path


def _scale_out(e) -> list[dict]:
    """The scale-out's span and its steps inside it, one after another."""
    args = {"te": e.te, "path": e.path, "source_te": e.source_te, "load": e.load}
    if e.fallback_from:
        args.update(fallback_from=e.fallback_from, fallback_s=e.fallback_s)
    spans = [_span(f"scale-out TE {e.te}", SCALER_TID, e.decided_s, e.serves_s, args)]
    at_s = e.decided_s
    for name, seconds in e.steps:
        spans.append(_span(name, SCALER_TID, at_s, at_s + seconds, {"te": e.te}))
        at_s += seconds
    return spans


def _span(name: str, tid: int, start_s: float, end_s: float, args: dict) -> dict:
    return {
        "name": name,
        "ph": "X",
        "pid": VIRTUAL_PID,
        "tid": tid,
        "ts": round(start_s * 1e6, 3),
        "dur": round((end_s - start_s) * 1e6, 3),
        "args": args,
    }


def _instant(name: str, tid: int, at_s: float) -> dict:
    ts = round(at_s * 1e6, 3)
    return {"name": name, "ph": "i", "s": "t", "pid": VIRTUAL_PID, "tid": tid, "ts": ts}


def _metadata(track_names: list[str]) -> list[dict]:
    """The virtual clock's process, the autoscaler's track first, then one per TE (and pool
    rank)."""
    pid = VIRTUAL_PID
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": CLOCK_NAMES[pid]}}]
    for tid, name in enumerate(["autoscaler", *track_names]):
        meta.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
        )
        meta.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    return meta
