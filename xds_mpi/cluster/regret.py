"""Regret in hindsight of the JE's routing (docs/routing.md): for each request, how much sooner
the TE that would have finished it first would have, an *estimate* from the run itself.

The JCT a request would have had on another TE is not observed (the run served it once). It is
estimated from what that TE gave comparable requests at about the same time: among the requests
routed to TE k (other than this one), those of similar size (priced prompt plus output tokens
within a factor SIZE_FACTOR of its own; all of k's when none is), the NUM_NEIGHBOURS routed
nearest in virtual time; the estimate is the median of their JCTs, each scaled by the size ratio
(this request's size over theirs). On its own TE a request's JCT is the observed one. The
estimated best TE is the one of least JCT, the regret the observed JCT minus the best (>= 0,
0 when the choice was the estimated best). A TE that served nothing gives no estimate.

JCT: arrival to last token on the virtual clock (queueing included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NUM_NEIGHBOURS = 4
SIZE_FACTOR = 2.0
REGRET_COLUMNS = ("jct_s", "est_best_te", "est_best_jct_s", "regret_s")


@dataclass(frozen=True, kw_only=True)
class Served:
    """A routed request as the run served it: te; routed_s: the JE's decision (virtual);
    size: priced prompt plus output tokens; jct_s: arrival to last token (virtual)."""

    req_id: int
    te: int
    routed_s: float
    size: int
    jct_s: float


@dataclass(frozen=True, kw_only=True)
class Regret:
    """req_id's observed jct_s on te; est_best_te and its est_best_jct_s (te and jct_s when the
    choice was the estimated best); regret_s = jct_s - est_best_jct_s >= 0."""

    req_id: int
    te: int
    jct_s: float
    est_best_te: int
    est_best_jct_s: float

    @property
    def regret_s(self) -> float:
        return self.jct_s - self.est_best_jct_s

    @property
    def is_best(self) -> bool:
        return self.est_best_te == self.te


def served_requests(records: dict, times: Sequence, te_of: dict, routed_s: dict) -> list[Served]:
    """The requests of a run that produced tokens: records (req_id -> RequestRecord), times
    (xds_mpi/results/virtual.py VirtualTimes), each one's TE and routing time."""
    out = []
    for t in times:
        if t.req_id not in te_of:
            continue
        req = records[t.req_id].req
        out.append(
            Served(
                req_id=t.req_id,
                te=te_of[t.req_id],
                routed_s=routed_s.get(t.req_id, t.decided_s),
                size=req.priced_prompt_len + req.priced_output_len,
                jct_s=t.e2e_s,
            )
        )
    return out


def estimate_jct(req: Served, on_te: Sequence[Served]) -> float:
    """req's JCT on the TE that served `on_te`, from them (NaN: none to go by)."""
    others = [s for s in on_te if s.req_id != req.req_id]
    similar = [s for s in others if max(s.size, req.size) <= SIZE_FACTOR * min(s.size, req.size)]
    pool = similar or others
    if not pool:
        return math.nan
    near = sorted(pool, key=lambda s: (abs(s.routed_s - req.routed_s), s.req_id))
    return float(np.median([s.jct_s * req.size / s.size for s in near[:NUM_NEIGHBOURS]]))


def regrets(served: Sequence[Served], num_tes: int) -> list[Regret]:
    """Every served request's estimated best TE and regret, in req_id order."""
    by_te: list[list[Served]] = [[] for _ in range(num_tes)]
    for s in served:
        by_te[s.te].append(s)
    out = []
    for req in sorted(served, key=lambda s: s.req_id):
        best_te, best_s = req.te, req.jct_s
        for te in range(num_tes):
            if te == req.te:
                continue
            est = estimate_jct(req, by_te[te])
            if est < best_s:  # NaN never is
                best_te, best_s = te, est
        out.append(
            Regret(
                req_id=req.req_id, te=req.te, jct_s=req.jct_s, est_best_te=best_te,
                est_best_jct_s=best_s,
            )
        )  # fmt: skip
    return out


def regret_summary(rows: Sequence[Regret]) -> dict:
    """The /summary attributes: regret_requests, regret_mean_ms, regret_p90_ms and
    regret_best_share (the share of requests routed to their estimated best TE)."""
    values = np.array([r.regret_s for r in rows]) * 1e3
    return {
        "regret_requests": len(rows),
        "regret_mean_ms": float(values.mean()) if len(values) else 0.0,
        "regret_p90_ms": float(np.percentile(values, 90)) if len(values) else 0.0,
        "regret_best_share": sum(r.is_best for r in rows) / len(rows) if rows else 0.0,
    }


def write_regret(group, rows: Sequence[Regret], routed_ids: Sequence[int]) -> None:
    """REGRET_COLUMNS beside the decision log's rows (`routed_ids`, its req_id column): NaN and
    -1 for a request that produced no token."""
    by_id = {r.req_id: r for r in rows}
    empty = Regret(req_id=-1, te=-1, jct_s=math.nan, est_best_te=-1, est_best_jct_s=math.nan)
    found = [by_id.get(int(i), empty) for i in routed_ids]
    group["jct_s"] = np.array([r.jct_s for r in found], np.float64)
    group["est_best_te"] = np.array([r.est_best_te for r in found], np.int64)
    group["est_best_jct_s"] = np.array([r.est_best_jct_s for r in found], np.float64)
    group["regret_s"] = np.array([r.regret_s for r in found], np.float64)


def read_regret(path) -> dict:
    """A run file's routing in hindsight, for a report: its policy and regret summary
    (regret_summary's keys, from /summary) and per routed request (/cluster/decisions) req_id,
    te, est_best_te, jct_s, est_best_jct_s, regret_s."""
    import h5py  # lazy: only a report reads a run file back

    with h5py.File(path, "r") as f:
        out = {"policy": str(f["cluster"].attrs["policy"])}
        summary = f["summary"].attrs
        out.update({k: summary[k] for k in ("regret_requests", "regret_mean_ms",
                                            "regret_p90_ms", "regret_best_share")})  # fmt: skip
        group = f["cluster/decisions"]
        for name in ("req_id", "te", *REGRET_COLUMNS):
            out[name] = group[name][()]
    return out


def format_regret(s: dict) -> str:
    return (
        f"routing in hindsight ({s['policy']}, estimated from the run): "
        f"{s['regret_best_share']:.0%} of {s['regret_requests']} requests on their estimated "
        f"best TE; regret mean {s['regret_mean_ms']:.1f} ms, p90 {s['regret_p90_ms']:.1f} ms"
    )
