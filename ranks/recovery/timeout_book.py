"""Failure records for XCCL waits that timed out and were recomputed (faults.on_timeout
recompute, xDeepServe §6.2 stage 3): the dies' recomputation counters name the first timeout
(the waiting die, the die its wait leads to: xccl/recovery/vote.py Outcome.blamed, when); the record
of
the stuck row on that peer says so, or, when no row names the peer, a record of kind `none` does
(a slow die nobody injected).
"""

from __future__ import annotations

from dataclasses import replace

from xds_mpi.failures import FailureRecord


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
