"""What a fault cost a run, read back from its run file on the virtual clock, for comparing
recovery policies (`xds-mpi bench recovery`, docs/failures.md "Recovery policies compared").

Every number comes from the groups the TE-shell wrote: /virtual (each request's arrival,
decision, admission, first token and finish), /requests (status, reason, prompt length),
/failures (xds_mpi/results/failures.py: injection and detection on the virtual clock, the
requests a failover moved) and /summary (the SLOs, rollbacks, the check). How each is derived:

- goodput: the window's requests whose virtual TTFT and TPOT meet run.slo_ttft_ms and
  run.slo_tpot_ms (the rule of xds_mpi/results/virtual.py), over every request of the window:
  a lost request counts as a miss;
- fault: the earliest injection of a failure record; detected: the earliest detection;
- resumed: the first decision after the detection. The TE-shell decides nothing during a
  failover and decides the readmitted requests at the survivors' resumption
  (docs/virtual_time.md), so with a request moved it is the resumption itself; with none, the
  next arrival after it (a bound from above);
- recovered: compared with a fault-free run of the same window (`recovered_s`), the arrival
  from which every later request's TTFT is back within a slack of its fault-free TTFT;
- tokens re-prefilled: the prompts of the requests a failover moved, which the survivors
  prefill again, plus the tokens those had emitted; the run file does not date each token, so
  the emitted ones are counted exactly only for a request whose first token came after the
  fault (none before it), and `reprefill_is_exact` says whether that held for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from xds_mpi.results.failures import FailureRecord, read_failures

NAN = math.nan


@dataclass(frozen=True, kw_only=True)
class RequestTimes:
    """The window's requests on the virtual clock, req_id order, each array [num_requests]:
    arrival_s, decided_s (the TE-shell picked its DP group), first_token_s, finish_s, ttft_s,
    tpot_s (nan: no token, or a single one for tpot_s); is_good: met both SLOs; status: "done",
    "lost", "rejected", "cancelled"."""

    req_id: np.ndarray  # int64
    arrival_s: np.ndarray  # float64
    decided_s: np.ndarray  # float64
    first_token_s: np.ndarray  # float64
    finish_s: np.ndarray  # float64
    ttft_s: np.ndarray  # float64
    tpot_s: np.ndarray  # float64
    is_good: np.ndarray  # bool
    status: np.ndarray  # str


@dataclass(frozen=True, kw_only=True)
class RecoveryRun:
    """One run file read for the comparison. status: the run file's ("completed" or "failed:
    <why>"); when a run stopped, the file holds no requests (requests is None, the counts 0).
    lost: (req_id, reason) of each request a failure ended. fault_s, detected_s, resumed_s:
    virtual seconds (nan: no fault, never detected, nothing decided after). Times in ms."""

    status: str
    num_requests: int
    num_done: int
    lost: tuple[tuple[int, str], ...]
    goodput_requests: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    fault_s: float
    detected_s: float
    resumed_s: float
    detected_by: str
    verdict: str
    recovery: str
    num_moved: int
    reprefill_tokens: int
    reprefill_is_exact: bool
    recomputed_iterations: int
    check_mismatches: int  # -1: not checked
    requests: RequestTimes | None

    @property
    def is_completed(self) -> bool:
        return self.status == "completed"

    @property
    def goodput_fraction(self) -> float:
        return self.goodput_requests / self.num_requests if self.num_requests else 0.0

    @property
    def detect_s(self) -> float:
        """Fault -> detection, virtual seconds (nan: none)."""
        return self.detected_s - self.fault_s

    @property
    def resume_s(self) -> float:
        """Fault -> the first decision after the detection, virtual seconds (nan: none)."""
        return self.resumed_s - self.fault_s


def read_recovery(path: str | Path) -> RecoveryRun:
    """The run file at `path` read for the comparison."""
    with h5py.File(path, "r") as f:
        status = str(f.attrs["status"])
        records = read_failures(f)
        summary = dict(f["summary"].attrs) if "summary" in f else {}
        requests = _request_times(f, summary) if "virtual" in f else None
        prompt_len = _prompt_len(f)
        reasons = f["requests/reason"].asstr()[()] if "requests" in f else []
    fault = _fault(records)
    moved = sorted({r for rec in records for r in rec.requests_affected})
    reprefill, is_exact = _reprefill(requests, moved, prompt_len, fault["fault_s"])
    lost = () if requests is None else _lost(requests, reasons)
    return RecoveryRun(
        status=status,
        num_requests=0 if requests is None else len(requests.req_id),
        num_done=0 if requests is None else int((requests.status == "done").sum()),
        lost=lost,
        goodput_requests=0 if requests is None else int(requests.is_good.sum()),
        ttft_p99_ms=_p99_ms(None if requests is None else requests.ttft_s),
        tpot_p99_ms=_p99_ms(None if requests is None else requests.tpot_s),
        **fault,
        resumed_s=_resumed(requests, fault["detected_s"]),
        num_moved=len(moved),
        reprefill_tokens=reprefill,
        reprefill_is_exact=is_exact,
        recomputed_iterations=int(summary.get("recomputed_iterations", 0)),
        check_mismatches=int(summary.get("check_mismatches", -1)),
        requests=requests,
    )


def recovered_s(run: RecoveryRun, baseline: RecoveryRun, *, slack_s: float) -> float:
    """Virtual seconds from the fault to the arrival from which every request of `run` is served
    with a TTFT within `slack_s` of the same request's in the fault-free `baseline` (0: no
    request after the fault was slower; nan: no fault, no requests, or still slower at the
    window's last arrival). A lost request is never back."""
    if math.isnan(run.fault_s) or run.requests is None or baseline.requests is None:
        return NAN
    ours, base = run.requests, baseline.requests
    base_ttft = dict(zip(base.req_id.tolist(), base.ttft_s.tolist(), strict=True))
    after = np.flatnonzero(ours.arrival_s >= run.fault_s)
    after = after[np.argsort(ours.arrival_s[after], kind="stable")]
    if not len(after):
        return NAN
    late = [
        not (ours.ttft_s[i] <= base_ttft.get(int(ours.req_id[i]), NAN) + slack_s) for i in after
    ]
    if not any(late):
        return 0.0
    last = max(k for k, is_late in enumerate(late) if is_late)
    if last == len(after) - 1:
        return NAN
    return float(ours.arrival_s[after[last + 1]]) - run.fault_s


def goodput_over_time(run: RecoveryRun) -> tuple[np.ndarray, np.ndarray]:
    """(virtual finish times [good], the requests that met both SLOs finished by each [good]):
    the goodput served over virtual time, flat while nothing good finishes."""
    if run.requests is None:
        return np.zeros(0), np.zeros(0, np.int64)
    finish = np.sort(run.requests.finish_s[run.requests.is_good])  # [good]
    return finish, np.arange(1, len(finish) + 1)


def _request_times(f: h5py.File, summary: dict) -> RequestTimes:
    """Every request of /requests, with the /virtual times of those that produced a token."""
    req_id = f["requests/req_id"][()]
    status = f["requests/status"].asstr()[()]
    index = {int(r): i for i, r in enumerate(req_id)}
    names = ("decided_s", "first_token_s", "finish_s", "ttft_s", "tpot_s")
    columns = {name: np.full(len(req_id), NAN) for name in names}
    arrival = f["requests/arrival_s"][()].astype(float)
    virtual = f["virtual"]
    rows = [index[int(r)] for r in virtual["req_id"][()]]
    for name in columns:
        columns[name][rows] = virtual[name][()]
    arrival[rows] = virtual["arrival_s"][()]
    slo_ttft_s = float(summary["slo_ttft_ms"]) / 1e3
    slo_tpot_s = float(summary["slo_tpot_ms"]) / 1e3
    tpot = columns["tpot_s"]
    is_good = (status == "done") & (columns["ttft_s"] < slo_ttft_s)
    is_good &= np.isnan(tpot) | (tpot < slo_tpot_s)
    return RequestTimes(req_id=req_id, arrival_s=arrival, status=status, is_good=is_good, **columns)


def _fault(records: list[FailureRecord]) -> dict:
    """The earliest injection and detection among the records, and the first detected record's
    detector, verdict and recovery."""
    injected = [r.injected_virtual_s for r in records if r.injected_virtual_s >= 0]
    detected = sorted(
        (r for r in records if r.detected_virtual_s >= 0), key=lambda r: r.detected_virtual_s
    )
    first = detected[0] if detected else next(iter(records), None)
    return {
        "fault_s": min(injected, default=NAN),
        "detected_s": detected[0].detected_virtual_s if detected else NAN,
        "detected_by": first.detected_by if first else "",
        "verdict": first.verdict if first else "",
        "recovery": first.recovery if first else "",
    }


def _resumed(requests: RequestTimes | None, detected_s: float) -> float:
    """The first decision at or after the detection (nan: none, or never detected)."""
    if requests is None or math.isnan(detected_s):
        return NAN
    later = requests.decided_s[requests.decided_s >= detected_s]
    return float(later.min()) if len(later) else NAN


def _prompt_len(f: h5py.File) -> dict[int, int]:
    if "requests" not in f:
        return {}
    ids, lengths = f["requests/req_id"][()], f["requests/prompt_len"][()]
    return {int(r): int(n) for r, n in zip(ids, lengths, strict=True)}


def _reprefill(
    requests: RequestTimes | None, moved: list[int], prompt_len: dict, fault_s: float
) -> tuple[int, bool]:
    """(the moved requests' prompt tokens + the tokens they emitted before the fault, whether
    that count is exact): a moved request whose first token came before the fault emitted an
    unknown number of them, counted as one."""
    if requests is None or not moved:
        return 0, True
    first = dict(zip(requests.req_id.tolist(), requests.first_token_s.tolist(), strict=True))
    emitted_before = [first.get(r, NAN) < fault_s for r in moved]
    tokens = sum(int(prompt_len[r]) for r in moved) + sum(emitted_before)
    return tokens, not any(emitted_before)


def _lost(requests: RequestTimes, reasons) -> tuple[tuple[int, str], ...]:
    return tuple(
        (int(r), str(reason))
        for r, s, reason in zip(requests.req_id, requests.status, reasons, strict=True)
        if s == "lost"
    )


def _p99_ms(values: np.ndarray | None) -> float:
    if values is None:
        return NAN
    values = values[~np.isnan(values)]
    return float(np.percentile(values, 99) * 1e3) if len(values) else NAN
