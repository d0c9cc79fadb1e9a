"""Each request's times on the virtual clock (run.clock virtual, docs/virtual_time.md), queueing
included: arrival, decision (the TE-shell picked its DP group), admission (the virtual start of
the first iteration it ran in), first token and finish (the virtual end of the iterations that
sampled them). From them TTFT (arrival -> first token), TPOT, queueing delay (arrival ->
admission), end-to-end latency, their percentiles and the goodput at run.slo_ttft_ms and
run.slo_tpot_ms; the run file keeps them in /virtual."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from xds_mpi.config.schema import Config

QUANTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "queue", "e2e")


@dataclass(frozen=True, kw_only=True)
class VirtualTimes:
    """One served request on the virtual clock, seconds since the run's virtual 0."""

    req_id: int
    arrival_s: float
    decided_s: float
    admitted_s: float
    first_token_s: float
    finish_s: float
    num_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.num_tokens < 2:
            return math.nan
        return (self.finish_s - self.first_token_s) / (self.num_tokens - 1)

    @property
    def queue_s(self) -> float:
        return self.admitted_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    def meets(self, cfg: Config) -> bool:
        tpot = self.tpot_s
        return self.ttft_s * 1e3 < cfg.run.slo_ttft_ms and (
            math.isnan(tpot) or tpot * 1e3 < cfg.run.slo_tpot_ms
        )


def virtual_times(records: dict, admitted: dict[int, float]) -> list[VirtualTimes]:
    """Every request that produced a token, in req_id order. records: req_id ->
    engine.results.RequestRecord (token_vtimes: the sampling iterations' virtual ends;
    dispatched_vtime: the decision); admitted: req_id -> admission (nan: not reported)."""
    out = []
    for req_id in sorted(records):
        record = records[req_id]
        if record.rejected or record.lost or not record.tokens:
            continue
        out.append(
            VirtualTimes(
                req_id=req_id,
                arrival_s=record.req.arrival_s,
                decided_s=record.dispatched_vtime,
                admitted_s=admitted.get(req_id, math.nan),
                first_token_s=record.token_vtimes[0],
                finish_s=record.token_vtimes[-1],
                num_tokens=len(record.tokens),
            )
        )
    return out


def virtual_summary(cfg: Config, times: list[VirtualTimes], wall_s: float) -> dict:
    """The /summary attributes: percentiles in ms of each metric (`virtual_ttft_ms_p50` ...),
    the goodput on the virtual clock, the virtual span served and its ratio to wall time."""
    num = len(times)
    good = sum(t.meets(cfg) for t in times)
    span_s = max((t.finish_s for t in times), default=0.0)
    out = {
        "virtual_goodput_requests": good,
        "virtual_goodput_fraction": good / num if num else 0.0,
        "virtual_span_s": span_s,
        "virtual_over_wall": span_s / wall_s if wall_s > 0 else 0.0,
    }
    for name in METRICS:
        values = np.array([getattr(t, f"{name}_s") for t in times]) * 1e3
        values = values[~np.isnan(values)]
        for q in QUANTILES:
            out[f"virtual_{name}_ms_p{q}"] = float(np.percentile(values, q)) if len(values) else 0.0
    return out


def format_virtual(s: dict, wall_s: float) -> str:
    def percentiles(name: str) -> str:
        return "/".join(f"{s[f'virtual_{name}_ms_p{q}']:.1f}" for q in QUANTILES)

    return (
        f"virtual clock (910C, queueing included): {s['virtual_span_s']:.3f} s served in "
        f"{wall_s:.2f} s wall ({s['virtual_over_wall']:.2f}x); queueing p50/p90/p99 "
        f"{percentiles('queue')} ms; TTFT {percentiles('ttft')} ms; TPOT {percentiles('tpot')} "
        f"ms; end-to-end {percentiles('e2e')} ms; goodput {s['virtual_goodput_requests']} "
        f"requests ({s['virtual_goodput_fraction']:.0%})"
    )


def write_virtual(f, times: list[VirtualTimes]) -> None:
    """/virtual: one row per request that produced a token (req_id order), virtual seconds."""
    group = f.create_group("virtual")
    group["req_id"] = np.array([t.req_id for t in times], np.int64)
    for name in ("arrival_s", "decided_s", "admitted_s", "first_token_s", "finish_s"):
        group[name] = np.array([getattr(t, name) for t in times], np.float64)
    group["num_tokens"] = np.array([t.num_tokens for t in times], np.int64)
    for name in METRICS:
        group[f"{name}_s"] = np.array([getattr(t, f"{name}_s") for t in times], np.float64)
