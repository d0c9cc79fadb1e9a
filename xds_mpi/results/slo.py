"""SLOs and goodput (`run.slo_ttft_ms`, `run.slo_tpot_ms`; xDeepServe: "a TTFT SLA under 2 s
and a TPOT SLA of 35 ms"): per served request its TTFT and TPOT on both clocks (wall: what this
machine took at the served lengths; projected: `xds_mpi.results.request_pricing` at the priced
lengths), the percentiles of each, and the goodput: the requests that meet both SLOs on the
projected clock. A request of one output token has no TPOT and meets that SLO."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.config.schema import Config

QUANTILES = (50, 90, 99)


@dataclass(frozen=True, kw_only=True)
class RequestTimes:
    """One served request's seconds: TTFT and TPOT on the wall and the projected clock (TPOT
    nan with one token), and the leading prompt tokens priced as pulled from a pool."""

    req_id: int
    ttft_s: float
    tpot_s: float
    ttft_v_s: float
    tpot_v_s: float
    cached_tokens: int = 0

    def meets(self, cfg: Config, *, projected: bool = True) -> bool:
        ttft, tpot = (self.ttft_v_s, self.tpot_v_s) if projected else (self.ttft_s, self.tpot_s)
        return ttft * 1e3 < cfg.run.slo_ttft_ms and (
            np.isnan(tpot) or tpot * 1e3 < cfg.run.slo_tpot_ms
        )


def request_times(
    records: dict, started: float, pricer, *, cached: dict[int, int] | None = None, pool=None
) -> list[RequestTimes]:
    """Both clocks' times of every request that produced a token (rejected and lost ones
    have none). cached: req_id -> leading prompt tokens priced as pulled from a KV pool over
    `pool` (a `request_pricing.Plane`) instead of computed."""
    out = []
    for record in records.values():
        if record.rejected or record.lost or not record.tokens:
            continue
        num_cached = (cached or {}).get(record.req.req_id, 0)
        priced = pricer.price(record.req, num_cached, pool)
        out.append(
            RequestTimes(
                req_id=record.req.req_id,
                ttft_s=record.ttft_s(started + record.req.arrival_s),
                tpot_s=record.tpot_s(),
                ttft_v_s=priced.ttft_s,
                tpot_v_s=priced.tpot_s if record.req.priced_output_len > 1 else float("nan"),
                cached_tokens=num_cached,
            )
        )
    return out


def slo_summary(cfg: Config, times: list[RequestTimes]) -> dict:
    """Goodput on the projected clock (and, for comparison, on the wall clock) and the TTFT and
    TPOT percentiles of both clocks, in ms."""
    num = len(times)
    good = sum(t.meets(cfg) for t in times)
    good_wall = sum(t.meets(cfg, projected=False) for t in times)
    out = {
        "slo_ttft_ms": cfg.run.slo_ttft_ms,
        "slo_tpot_ms": cfg.run.slo_tpot_ms,
        "goodput_requests": good,
        "goodput_fraction": good / num if num else 0.0,
        "goodput_wall_requests": good_wall,
    }
    for name in ("ttft", "tpot", "ttft_v", "tpot_v"):
        values = np.array([getattr(t, f"{name}_s") for t in times]) * 1e3
        values = values[~np.isnan(values)]
        clock = "projected" if name.endswith("_v") else "wall"
        for q in QUANTILES:
            key = f"{clock}_{name.removesuffix('_v')}_ms_p{q}"
            out[key] = float(np.percentile(values, q)) if len(values) else 0.0
    return out


def cached_summary(cfg: Config, times: list[RequestTimes]) -> dict:
    """The projected goodput and TTFT percentiles when each request's cached prefix is pulled
    from a pool (`cache_` keys)."""
    full = slo_summary(cfg, times)
    keys = ["goodput_requests", "goodput_fraction"] + [f"projected_ttft_ms_p{q}" for q in QUANTILES]
    return {f"cache_{key}": full[key] for key in keys}


def format_cached(s: dict) -> str:
    ttft = "/".join(f"{s[f'cache_projected_ttft_ms_p{q}']:.1f}" for q in QUANTILES)
    return (
        f"with the prefix hits pulled over UB (an unbounded pool, priced, not served): goodput "
        f"{s['cache_goodput_requests']} requests ({s['cache_goodput_fraction']:.0%}); TTFT "
        f"p50/p90/p99 projected {ttft} ms"
    )


def format_slo(s: dict) -> str:
    def percentiles(clock: str, name: str) -> str:
        return "/".join(f"{s[f'{clock}_{name}_ms_p{q}']:.1f}" for q in QUANTILES)

    return (
        f"SLO (TTFT < {s['slo_ttft_ms']:g} ms, TPOT < {s['slo_tpot_ms']:g} ms, projected "
        f"clock): goodput {s['goodput_requests']} requests ({s['goodput_fraction']:.0%}); "
        f"{s['goodput_wall_requests']} on the wall clock; TTFT p50/p90/p99 projected "
        f"{percentiles('projected', 'ttft')} ms, wall {percentiles('wall', 'ttft')} ms; TPOT "
        f"projected {percentiles('projected', 'tpot')} ms, wall {percentiles('wall', 'tpot')} ms"
    )


def write_slo(
    f, times: list[RequestTimes], cached: list[RequestTimes] = (), ems: list[RequestTimes] = ()
) -> None:
    """/slo: per request that produced a token (req_id order), TTFT and TPOT on both clocks;
    with `cached` (a trace replay) also the projected TTFT with its prefix hits pulled from a
    pool (`cache_ttft_v_s`) and those hits' prompt tokens at the trace's lengths
    (`cache_cached_tokens`); with `ems` (a trace replay on the EMS pool) the same for the
    prefix the pool really served (`ems_ttft_v_s`, `ems_cached_tokens`)."""
    ordered = sorted(times, key=lambda t: t.req_id)
    group = f.create_group("slo")
    group["req_id"] = np.array([t.req_id for t in ordered], np.int64)
    for name in ("ttft_s", "tpot_s", "ttft_v_s", "tpot_v_s"):
        group[name] = np.array([getattr(t, name) for t in ordered])
    for prefix, priced in (("cache", cached), ("ems", ems)):
        if priced:
            by_id = {t.req_id: t for t in priced}
            group[f"{prefix}_ttft_v_s"] = np.array([by_id[t.req_id].ttft_v_s for t in ordered])
            group[f"{prefix}_cached_tokens"] = np.array(
                [by_id[t.req_id].cached_tokens for t in ordered], np.int64
            )
