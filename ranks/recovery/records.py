"""The TE-shell's failure records for the decode dies' `stuck` and `dead` rows (xDeepServe §6):
one xds_mpi/results/failures.py FailureRecord per row, from what the dies noted (when their
fault began) and what the detector concluded (ranks/recovery/detector.py).

XCCL waits that timed out and were recomputed (faults.on_timeout recompute, §6.2 stage 3,
`with_timeouts`): the dies' recomputation counters name the first timeout (the waiting die, the
die its wait leads to: xccl/recovery/vote.py Outcome.blamed, when); the record of the stuck row on
that peer says so, or, when no row names the peer, a record of kind `none` does (a slow die
nobody injected).

Projected detection time: heartbeats are a wall-clock mechanism (intervals and timeout are the
same seconds on the pod), so the detection lands at the die's virtual injection time plus the
wall seconds from injection to detection; on the virtual clock (run.clock virtual) it is priced
instead (ranks/recovery/scale_down.py, xds_mpi/plan/failures/loss.py FailoverCost): the fault's
virtual time plus health.timeout_s and one health.dp_interval_s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ranks.core.messages import FaultBegan
from xds_mpi.config.schema import Config
from xds_mpi.results.failures import FailureRecord
from xds_mpi.results.results import RequestRecord

# tokens/s before a fault (from serving's start at the earliest) and after it, or after the
# dies resumed: over this many wall seconds.
RATE_WINDOW_S = 3.0


@dataclass(frozen=True, kw_only=True)
class Detection:
    """What one fence concluded: wall_time (time.time()) of the fence; verdicts: the dies judged
    -> "dead" (still silent after the release and after) or "stuck" (answered again, later);
    recovery: what was done, in words; affected: the requests moved; resumed_wall: when the
    dies served again (-1: the run stopped); detected_virtual_s, on the virtual clock: the
    detection priced there (xds_mpi/plan/failures/loss.py FailoverCost), -1 elsewhere."""

    wall_time: float
    verdicts: dict[int, str] = field(default_factory=dict)
    recovery: str = ""
    affected: tuple[int, ...] = ()
    resumed_wall: float = -1.0
    detected_virtual_s: float = -1.0  # run.clock virtual: priced (scale_down.py), else -1


def failure_records(
    cfg: Config,
    roles: dict[int, str],
    began: dict[int, FaultBegan],
    requests: dict[int, RequestRecord],
    *,
    started: float,
    detections: list[Detection],
) -> list[FailureRecord]:
    """One record per stuck/dead row, then one per silent die no row names (a false verdict).
    roles: die rank -> role; started: wall time serving started."""
    rows = [e for e in cfg.faults.events if e.kind in ("stuck", "dead")]
    naming = {die: d for d in detections for die in d.verdicts}  # die -> its detection
    out = [
        _record(
            kind=row.kind,
            die=row.die,
            roles=roles,
            note=began.get(row.die),
            requests=requests,
            started=started,
            iteration=-1 if row.iteration is None else row.iteration,
        )  # -1: an at_s row
        for row in rows
    ]
    named = {row.die for row in rows}
    out += [
        _record(
            kind="none",
            die=die,
            iteration=-1,
            roles=roles,
            note=None,
            requests=requests,
            started=started,
        )
        for die in sorted(naming)
        if die not in named
    ]
    return [_judged(r, naming.get(r.die), began.get(r.die), started, requests) for r in out]


def _record(*, kind, die, iteration, roles, note, requests, started) -> FailureRecord:
    if note is None:
        return FailureRecord(
            kind=kind,
            die=die,
            role=roles[die],
            injected_iteration=iteration,
            injected_wall_s=-1.0,
            injected_virtual_s=-1.0,
            recovery="never injected: the run ended before it" if kind != "none" else "",
        )
    at = note.wall_time
    return FailureRecord(
        kind=kind,
        die=die,
        role=roles[die],
        injected_iteration=note.iteration,
        injected_wall_s=at - started,
        injected_virtual_s=note.virtual_s,
        verdict="transient" if kind == "stuck" else "",
        recovery="none needed: the die came back before health.timeout_s; its peers waited "
        "in their XCCL waits"
        if kind == "stuck"
        else "",
        tokens_per_s_before=tokens_per_s(requests, max(at - RATE_WINDOW_S, started), at),
        tokens_per_s_after=tokens_per_s(requests, at, at + RATE_WINDOW_S),
    )


def _judged(record: FailureRecord, detection, note, started, requests) -> FailureRecord:
    """The record with the verdict of the detection that named its die (None: unchanged)."""
    if detection is None:
        return record
    resumed = detection.resumed_wall
    detected_virtual_s = detection.detected_virtual_s
    if detected_virtual_s < 0:  # the wall clock: projected from the wall seconds it took
        detected_virtual_s = note.virtual_s + detection.wall_time - note.wall_time if note else -1.0
    return replace(
        record,
        detected_wall_s=detection.wall_time - started,
        detected_virtual_s=detected_virtual_s,
        detected_by="heartbeat",
        verdict=detection.verdicts[record.die],
        recovery=detection.recovery,
        requests_affected=detection.affected or unfinished_on(requests, record.die),
        tokens_per_s_after=tokens_per_s(requests, resumed, resumed + RATE_WINDOW_S)
        if resumed > 0
        else record.tokens_per_s_after,
    )


def unfinished_on(requests: dict[int, RequestRecord], die: int) -> tuple[int, ...]:
    """The requests a die was serving and had not finished."""
    return tuple(sorted(i for i, r in requests.items() if r.die_rank == die and not r.finished_at))


def tokens_per_s(requests: dict[int, RequestRecord], t0: float, t1: float) -> float:
    """Tokens the TE-shell received in wall window [t0, t1), per second (0 for an empty one)."""
    if t1 <= t0:
        return 0.0
    count = sum(1 for r in requests.values() for t in r.token_times if t0 <= t < t1)
    return count / (t1 - t0)


def with_timeouts(
    records: list[FailureRecord], recovery: dict[int, dict], roles: dict[int, str], started: float
) -> list[FailureRecord]:
    """`records` with the first recomputed timeout in the dies' counters (`recovery`: die rank
    -> counters) attributed; started: wall time serving started."""
    seen = [c for c in recovery.values() if c and c.get("timeouts", 0) > 0]
    if not seen:
        return records
    first = min(seen, key=lambda c: c["timeout_wall"])
    peer, count = int(first["timeout_peer"]), max(c["timeouts"] for c in seen)
    via = int(first.get("timeout_via", peer))
    waited = f"die rank {peer}" if via in (peer, -1) else f"die rank {via} (waiting for {peer})"
    recovery_text = (
        f"token recomputation: die rank {int(first['timeout_die'])}'s wait for {waited} "
        f"timed out (xccl.poll_timeout_s); every die recomputed the iteration ({count} "
        "attempts failed on a timeout)"
    )
    detected = {
        "detected_wall_s": float(first["timeout_wall"]) - started,
        "detected_by": "xccl timeout",
        "recovery": recovery_text,
    }
    named = [i for i, r in enumerate(records) if r.die == peer]
    if named:
        return _attributed(records, named[0], detected)
    slow = FailureRecord(
        kind="none",
        die=peer,
        role=roles.get(peer, "?"),
        injected_iteration=int(first["timeout_iteration"]),
        injected_wall_s=-1.0,
        injected_virtual_s=-1.0,
        verdict="slow",
        **detected,
    )
    return [*records, slow]


def _attributed(records: list[FailureRecord], i: int, detected: dict) -> list[FailureRecord]:
    """records[i], the peer's row, detected by the timeout if it was a transient stall."""
    r = records[i]
    if r.kind != "stuck" or r.verdict != "transient":
        return records  # the heartbeats found the peer lost: their record stands
    # Projected like the heartbeats' detection: injection plus the wall seconds since.
    late_s = detected["detected_wall_s"] - r.injected_wall_s
    out = list(records)
    out[i] = replace(r, **detected, detected_virtual_s=r.injected_virtual_s + late_s)
    return out
