"""What a PD run adds to the results (xDeepServe §5.1): per request, TTFT split into queueing,
prefill, KV transfer and first decode step, in wall and virtual (projected) time; the KV
transfers' count, bytes, throughput, deferred receives and retries; the `/pd` run-file group."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PARTS = ("queue", "prefill", "kv_wait", "kv_transfer", "first_step")


@dataclass(kw_only=True)
class PdBook:
    """The JE's view: tasks (req -> PdTask), transfers (req -> KvTransferDone), reports
    (prefill rank -> PrefillReport)."""

    tasks: dict = field(default_factory=dict)
    transfers: dict = field(default_factory=dict)
    reports: dict = field(default_factory=dict)
    ems_reports: dict = field(default_factory=dict)  # pool rank -> EmsPoolReport (ems.enabled)
    failures: list = field(default_factory=list)  # FailureRecord (xds_mpi/engine/pd_failover.py)

    def split_wall(self, record, arrival_wall: float) -> dict[str, float]:
        """Wall seconds of each TTFT part of a transferred request: queueing (arrival -> its
        first prefill step), prefill, KV wait (prefill done -> irecv posted: the JE's choice
        and any backpressure), KV transfer (posted -> received), first decode step."""
        task, done = self.tasks[record.req.req_id], self.transfers[record.req.req_id]
        return {
            "queue": task.prefill_start - arrival_wall,
            "prefill": task.prefill_end - task.prefill_start,
            "kv_wait": done.posted_at - task.prefill_end,
            "kv_transfer": done.completed_at - done.posted_at,
            "first_step": record.token_times[0] - done.completed_at,
        }

    def split_virtual(self, req_id: int) -> dict[str, float]:
        """Projected seconds: queueing and prefill on the prefill die's clock, the transfer on
        the UB link model at the cost shape, the first decode iteration on the decode clock
        (no wait for KV blocks is projected)."""
        task, done = self.tasks[req_id], self.transfers[req_id]
        return {
            "queue": task.queue_v,
            "prefill": task.prefill_v,
            "kv_wait": 0.0,
            "kv_transfer": done.transfer_v,
            "first_step": done.first_step_v,
        }

    def summary(self, records: dict, started: float) -> dict:
        moved = [r for r in records.values() if r.req.req_id in self.transfers and r.token_times]
        wall = [self.split_wall(r, started + r.req.arrival_s) for r in moved]
        virtual = [self.split_virtual(r.req.req_id) for r in moved]
        reports = self.reports.values()
        nbytes = sum(rep.bytes_sent for rep in reports)
        send_s = sum(rep.send_wall_s for rep in reports)
        out = {
            "pd_transfers": len(self.transfers),
            "pd_bytes": nbytes,
            "pd_mean_transfer_bytes": nbytes / max(len(self.transfers), 1),
            "pd_send_mb_per_s": nbytes / send_s / 1e6 if send_s else 0.0,
            "pd_recv_mb_per_s": _recv_rate(self.transfers.values()),
            "pd_deferred_receives": sum(d.num_deferred > 0 for d in self.transfers.values()),
            "pd_deferral_steps": sum(d.num_deferred for d in self.transfers.values()),
            "pd_retries": sum(d.num_retries for d in self.transfers.values()),
            "pd_retried_transfers": sum(d.num_retries > 0 for d in self.transfers.values()),
            "pd_send_faults": sum(rep.num_faults for rep in reports),
            "pd_recv_faults": sum(d.num_recv_faults for d in self.transfers.values()),
            "pd_failures": len(self.failures),
            "pd_false_verdicts": sum(r.kind == "none" for r in self.failures),
            "pd_failure_lines": "\n".join(r.describe() for r in self.failures),
        }
        if self.ems_reports:
            out.update(ems_summary(reports, self.ems_reports.values()))
        for part in PARTS:
            out[f"pd_ttft_{part}_ms"] = 1e3 * float(np.mean([w[part] for w in wall] or [0]))
            out[f"pd_ttft_{part}_v_ms"] = 1e3 * float(np.mean([v[part] for v in virtual] or [0]))
        return out

    def write(self, f, records: dict, started: float) -> None:
        """/pd: per transferred request (req_id order) each TTFT part, wall and virtual."""
        ids = sorted(r for r in self.transfers if records[r].token_times)
        group = f.create_group("pd")
        group["req_id"] = np.array(ids, np.int64)
        group["prefill_rank"] = np.array([self.tasks[r].prefill_rank for r in ids], np.int64)
        group["decode_rank"] = np.array([self.transfers[r].decode_rank for r in ids], np.int64)
        group["kv_bytes"] = np.array([self.transfers[r].nbytes for r in ids], np.int64)
        group["num_deferred"] = np.array([self.transfers[r].num_deferred for r in ids], np.int64)
        group["num_retries"] = np.array([self.transfers[r].num_retries for r in ids], np.int64)
        # kv_wait in two: the task's way to the decode die (JE), then its wait there (step 6)
        group["task_at_decode_s"] = np.array(
            [self.transfers[r].received_at - self.tasks[r].prefill_end for r in ids]
        )
        for part in PARTS:
            group[f"ttft_{part}_s"] = np.array(
                [self.split_wall(records[r], started + records[r].req.arrival_s)[part] for r in ids]
            )
            group[f"ttft_{part}_v_s"] = np.array([self.split_virtual(r)[part] for r in ids])


def _recv_rate(transfers) -> float:
    """MB/s of the KV bytes over the receivers' posted -> completed wall time (the last
    attempt's post: a retried transfer's failed attempts are not in it)."""
    transfers = list(transfers)
    seconds = sum(d.completed_at - d.posted_at for d in transfers)
    return sum(d.nbytes for d in transfers) / seconds / 1e6 if seconds > 0 else 0.0


def format_pd(s: dict) -> str:
    parts = ", ".join(f"{p} {s[f'pd_ttft_{p}_ms']:.1f}/{s[f'pd_ttft_{p}_v_ms']:.3f}" for p in PARTS)
    return (
        f"pd: {s['pd_transfers']} KV transfers over XCCL p2p, {s['pd_bytes']} B "
        f"(mean {s['pd_mean_transfer_bytes']:.0f} B), {s['pd_send_mb_per_s']:.1f} MB/s per send, "
        f"{s['pd_recv_mb_per_s']:.1f} MB/s irecv posted -> done; "
        f"{s['pd_deferred_receives']} receives deferred ({s['pd_deferral_steps']} steps); "
        f"{s['pd_retries']} retries of {s['pd_retried_transfers']} transfers "
        f"({s['pd_send_faults']} send, {s['pd_recv_faults']} receive faults); "
        f"TTFT wall/projected ms: {parts}"
    ) + "".join(f"\n{line}" for line in s["pd_failure_lines"].splitlines())


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


def ems_summary(prefill_reports, pool_reports) -> dict:
    """The EMS context cache's counts (docs/ems.md): the prefill dies' lookups, hits, blocks
    pulled, fallbacks and puts, the pool ranks' blocks stored, evictions and blocks held."""
    prefill_reports, pool_reports = list(prefill_reports), list(pool_reports)
    out = {f"ems_{k}": sum(rep.ems.get(k, 0) for rep in prefill_reports) for k in EMS_DIE_COUNTS}
    out["ems_lookup_wall_s"] = sum(rep.ems.get("lookup_wall_s", 0.0) for rep in prefill_reports)
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


def ems_trace_cached(cfg, records: dict, prefill_reports) -> dict[int, int]:
    """req_id -> the prompt tokens at the trace's lengths the EMS pool served each request: its
    pulled served tokens in whole trace blocks (trace.block_tokens x trace.length_scale served
    tokens each), at most all but the last token."""
    from xds_mpi.engine.trace_replay import cached_tokens

    hit: dict[int, int] = {}
    for rep in prefill_reports:
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
