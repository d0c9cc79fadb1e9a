"""The JE's side of KV-path failures in a PD run (xDeepServe §6.1 detection, §6.2 recovery),
torch-free: what the link probers reported, which decode dies each prefill die must avoid, and
one FailureRecord per injected `link` / `saturated` row (xds_mpi/results/failures.py), plus one per
verdict no injected fault explains (a false verdict, kind "none").

Recovery: a "link" verdict on pair prefill p -> decode d takes the pair out of use until a
dummy passes again ("restored"): the requests whose sends were withdrawn go to another decode
die (their KV then moves over another pair), and no new task of p goes to d. A "saturated"
verdict on d steers every new task away from d until a dummy passes in time ("cleared"); d is
used only when every other decode die is ruled out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from xds_mpi.results.failures import FailureRecord

VERDICTS = ("link", "saturated")


@dataclass(frozen=True, kw_only=True)
class Routed:
    """A PD-transfer task on its way to the decode TE-shell. hard: decode dies it must not go
    to (the pair from its prefill die is down); soft: dies to use only if nothing else is left
    (saturated); is_reroute: it was routed before (that die's load is given back first)."""

    task: object
    hard: tuple[int, ...] = ()
    soft: tuple[int, ...] = ()
    is_reroute: bool = False


def pick_decode(balancer, req, hard, soft) -> int:
    """§4.3's choice (lowest reserved KV, then fewest requests) among the allowed dies."""
    allowed = [g for g in balancer.groups if g not in hard]
    if not allowed:
        raise RuntimeError(
            f"request {req.req_id}: every decode die ({list(balancer.groups)}) is cut off from "
            "its prefill die by a link fault; nothing can take its KV"
        )
    preferred = [g for g in allowed if g not in soft] or allowed
    return min(preferred, key=lambda g: (balancer.reserved[g], balancer.num_pending[g], g))


@dataclass(kw_only=True)
class PdFailover:
    began: dict = field(default_factory=dict)  # faults.events row -> FaultBegan
    reports: list = field(default_factory=list)  # LinkReport, in arrival order
    down: set = field(default_factory=set)  # (prefill, decode) pairs out of use
    saturated: set = field(default_factory=set)  # decode dies steered around
    steered: dict = field(default_factory=dict)  # decode die -> requests routed around it

    def on_report(self, report) -> tuple[int, ...]:
        """Take a prober's report; the requests to re-route (withdrawn from a pair down)."""
        self.reports.append(report)
        pair = (report.prefill, report.decode)
        if report.kind == "link":
            self.down.add(pair)
        elif report.kind == "restored":
            self.down.discard(pair)
        elif report.kind == "saturated":
            self.saturated.add(report.decode)
        elif report.kind == "cleared":
            self.saturated.discard(report.decode)
        return report.req_ids if report.kind in ("link", "reroute") else ()

    def avoid(self, prefill: int, req_id: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The dies request req_id (from prefill die `prefill`) must / should not go to."""
        hard = tuple(sorted(d for p, d in self.down if p == prefill))
        for decode in self.saturated:
            self.steered.setdefault(decode, []).append(req_id)
        return hard, tuple(sorted(self.saturated))

    def records(self, rows, roles: dict, token_times: list[float], started: float, ended: float):
        """One FailureRecord per injected channel row, then one per unexplained verdict."""
        used: set[int] = set()
        out = []
        for i, spec in enumerate(rows):
            if spec.kind not in VERDICTS:
                continue
            mine = [k for k, r in enumerate(self.reports) if _concerns(spec, r)]
            used.update(mine)
            reports = [self.reports[k] for k in mine]
            record = _record(spec, roles, self.began.get(i), reports, token_times, started, ended)
            if spec.kind == "saturated":  # affected: the slow transfers and those steered away
                moved = set(record.requests_affected) | set(self.steered.get(spec.die, ()))
                record = replace(record, requests_affected=tuple(sorted(moved)))
            out.append(record)
        for k, r in enumerate(self.reports):
            if k not in used and r.kind in VERDICTS:
                out.append(_false_verdict(r, roles, started))
        return out


def loss_record(spec, began, loss, token_times, started: float, ended: float) -> FailureRecord:
    """A prefill die lost (dead / stuck for good), found by the JE's heartbeat
    (ranks/recovery/je_prefill_loss.py). Detection's projected time is its wall time added to the
    die's virtual clock at injection: heartbeat intervals and timeouts are real seconds on the
    pod as well."""
    injected = began.wall - started if began else -1.0
    detected = loss.wall - started if loss else -1.0
    recovery = (
        f"prefill instance lost: TE {loss.te} (dies {list(loss.ranks)}) taken out, "
        f"{len(loss.moved)} requests prefilled again on the live TEs"
        if loss
        else ""
    )
    return FailureRecord(
        kind=spec.kind,
        die=spec.die,
        role="prefill",
        injected_iteration=began.iteration if began else -1,
        injected_wall_s=injected,
        injected_virtual_s=began.virtual_s if began else -1.0,
        detected_wall_s=detected,
        detected_virtual_s=began.virtual_s + detected - injected if began and loss else -1.0,
        detected_by="heartbeat" if loss else "",
        verdict="silent" if loss else "",
        recovery=recovery,
        requests_affected=tuple(sorted(set(loss.moved))) if loss else (),
        tokens_per_s_before=_rate(token_times, started, started + max(injected, 0.0)),
        tokens_per_s_after=_rate(token_times, started + max(detected, injected, 0.0), ended),
    )


def _concerns(spec, report) -> bool:
    if spec.kind == "link":
        return (report.prefill, report.decode) == (spec.die, spec.peer)
    return report.decode == spec.die and report.kind != "reroute"


def _record(spec, roles, began, reports, token_times, started, ended) -> FailureRecord:
    verdicts = [r for r in reports if r.kind in VERDICTS]
    first = verdicts[0] if verdicts else None
    injected = began.wall - started if began else -1.0
    detected = first.wall - started if first else -1.0
    affected = sorted({i for r in reports for i in r.req_ids})
    return FailureRecord(
        kind=spec.kind,
        die=spec.die,
        role=roles[spec.die],
        injected_iteration=began.iteration if began else -1,
        injected_wall_s=injected,
        injected_virtual_s=began.virtual_s if began else -1.0,
        detected_wall_s=detected,
        detected_virtual_s=first.virtual_s if first else -1.0,
        detected_by="link probe" if first else "",
        verdict=first.kind if first else "",
        recovery=_recovery(spec, reports, started) if first else "",
        requests_affected=tuple(affected),
        tokens_per_s_before=_rate(token_times, started, started + max(injected, 0.0)),
        tokens_per_s_after=_rate(token_times, started + max(detected, injected, 0.0), ended),
    )


def _recovery(spec, reports, started) -> str:
    ends = [r.wall - started for r in reports if r.kind in ("restored", "cleared")]
    until = f"until {ends[0]:.2f} s" if ends else "to the end of the run"
    if spec.kind == "link":
        moved = sorted({i for r in reports if r.kind in ("link", "reroute") for i in r.req_ids})
        return (
            f"{len(moved)} requests re-routed to other decode dies; pair {spec.die} -> "
            f"{spec.peer} out of use {until}"
        )
    return f"new requests steered away from decode die {spec.die} {until}"


def _false_verdict(report, roles, started) -> FailureRecord:
    return FailureRecord(
        kind="none",
        die=report.decode,
        role=roles[report.decode],
        injected_iteration=-1,
        injected_wall_s=-1.0,
        injected_virtual_s=-1.0,
        detected_wall_s=report.wall - started,
        detected_virtual_s=report.virtual_s,
        detected_by="link probe",
        verdict=report.kind,
        recovery=f"false verdict on pair {report.prefill} -> {report.decode}",
        requests_affected=report.req_ids,
    )


def _rate(times: list[float], start: float, end: float) -> float:
    """Tokens per wall second streamed in [start, end)."""
    if end <= start:
        return 0.0
    return sum(1 for t in times if start <= t < end) / (end - start)
