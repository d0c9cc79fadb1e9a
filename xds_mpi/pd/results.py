"""What a PD run adds to the results (xDeepServe §5.1): per request, TTFT split into queueing,
prefill, KV transfer and first decode step, in wall and virtual (projected) time; the KV
transfers' count, bytes, throughput, deferred receives and retries; the `/pd` run-file group."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xds_mpi.ems.results import ems_summary

PARTS = ("queue", "prefill", "kv_wait", "kv_transfer", "first_step")


@dataclass(kw_only=True)
class PdBook:
    """The JE's view: tasks (req -> PdTask), transfers (req -> KvTransferDone), reports
    (prefill rank -> PrefillReport)."""

    tasks: dict = field(default_factory=dict)
    transfers: dict = field(default_factory=dict)
    reports: dict = field(default_factory=dict)
    ems_reports: dict = field(default_factory=dict)  # pool rank -> EmsPoolReport (ems.enabled)
    failures: list = field(default_factory=list)  # FailureRecord (xds_mpi/pd/failover.py)

    def split_wall(self, record, arrival_wall: float) -> dict[str, float]:
        """Wall seconds of each TTFT part of a transferred request: queueing (arrival -> its
        first prefill step), prefill, KV wait (prefill done -> irecv posted: the JE's choice
        and any backpressure), KV transfer (posted -> received), first decode step."""
        task, done = self.tasks[record.req.req_id], self.transfers[record.req.req_id]
        arrival_wall = record.wall_arrival or arrival_wall  # virtual clock: when it was decided
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
