"""What the EMS context cache adds to the results (docs/ems.md), for PD (the prefill dies'
reports) and colocated runs (the colocated dies' reports) alike: the dies' lookups, hits and puts,
the pool ranks' blocks stored, evictions and held, and on a trace replay each request's prefix
the pool really served at the trace's lengths."""

from __future__ import annotations

from xds_mpi.workload.trace_replay import cached_tokens

EMS_DIE_COUNTS = (
    "lookups",
    "requests_hit",
    "blocks_hit",
    "bytes_pulled",
    "tokens_skipped",
    "fallbacks",
    "lost_fallbacks",
    "evicts_injected",
    "blocks_put",
    "bytes_put",
)


def ems_summary(die_reports, pool_reports) -> dict:
    """The EMS context cache's counts (docs/ems.md): the client dies' lookups, hits, blocks
    pulled, fallbacks and puts, the pool ranks' blocks stored, evictions and blocks held."""
    die_reports, pool_reports = list(die_reports), list(pool_reports)
    out = {f"ems_{k}": sum(rep.ems.get(k, 0) for rep in die_reports) for k in EMS_DIE_COUNTS}
    out["ems_lookup_wall_s"] = sum(rep.ems.get("lookup_wall_s", 0.0) for rep in die_reports)
    out["ems_blocks_stored"] = sum(rep.num_put for rep in pool_reports)
    out["ems_puts_already_held"] = sum(rep.num_put_held for rep in pool_reports)
    out["ems_evictions"] = sum(rep.num_evicted for rep in pool_reports)
    out["ems_blocks_held"] = sum(rep.num_held for rep in pool_reports)
    out["ems_pool_ranks_lost"] = sum(rep.is_lost for rep in pool_reports)
    out["ems_puts_dropped"] = sum(rep.num_dropped for rep in pool_reports)
    return out


def format_ems(s: dict) -> str:
    return (
        f"ems: {s['ems_lookups']} lookups, {s['ems_requests_hit']} requests hit, "
        f"{s['ems_blocks_hit']} blocks pulled ({s['ems_bytes_pulled']} B, "
        f"{s['ems_tokens_skipped']} prompt tokens not computed), {s['ems_fallbacks']} fallbacks "
        f"to recompute; {s['ems_blocks_put']} blocks put ({s['ems_bytes_put']} B): "
        f"{s['ems_blocks_stored']} stored, {s['ems_puts_already_held']} already held, "
        f"{s['ems_evictions']} evictions, {s['ems_blocks_held']} held at the end"
        + (
            f"; faults: {s['ems_pool_ranks_lost']} pool rank(s) lost ({s['ems_puts_dropped']} "
            f"put messages dropped, {s['ems_lost_fallbacks']} of the fallbacks), "
            f"{s['ems_evicts_injected']} blocks evicted mid-lookup"
            if s["ems_pool_ranks_lost"] or s["ems_evicts_injected"]
            else ""
        )
    )


def ems_trace_cached(cfg, records: dict, die_reports) -> dict[int, int]:
    """req_id -> the prompt tokens at the trace's lengths the EMS pool served each request: its
    pulled served tokens in whole trace blocks (trace.block_tokens x trace.length_scale served
    tokens each), at most all but the last token."""
    hit: dict[int, int] = {}
    for rep in die_reports:
        hit.update(rep.ems.get("hit_tokens", {}))
    per_block = max(1, round(cfg.trace.block_tokens * cfg.trace.length_scale))
    served = [r.req for r in records.values() if not r.rejected]
    return {
        r.req_id: cached_tokens(r, hit.get(r.req_id, 0) // per_block, cfg.trace.block_tokens)
        for r in served
    }


def format_ems_slo(s: dict) -> str:
    ttft = "/".join(f"{s[f'ems_projected_ttft_ms_p{q}']:.1f}" for q in (50, 90, 99))
    return (
        f"with the EMS pool's own hits pulled over UB (served): goodput "
        f"{s['ems_goodput_requests']} requests ({s['ems_goodput_fraction']:.0%}); TTFT "
        f"p50/p90/p99 projected {ttft} ms"
    )
