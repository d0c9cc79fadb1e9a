"""The TE-shell (host rank): owns the request stream and reports on the job.

In a colocated or afd deployment it serves the workload (ranks/shell/frontend.py), prints a progress
line and a summary, and with run.check compares every served request with the single-process
reference.
At the end it writes the run file (xds_mpi/report/runfile.py) and names it on its last log line; a
run that fails still writes one, with status "failed: <why>", before the error aborts the job.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING

from ranks.core.context import RankContext
from ranks.core.handshake import handshake
from ranks.core.ready import await_ready
from ranks.recovery.detector import DecodeDieLost
from ranks.shell import decode_shell
from xccl.gmem import DieMemory, Traffic
from xds_mpi.report import trace
from xds_mpi.report.runfile import run_file_path, write_run_file
from xds_mpi.report.trace_writer import trace_path, write_trace
from xds_mpi.results.failures import with_resumed, write_failures
from xds_mpi.results.results import (
    check_against_reference,
    format_summary,
    summarize,
    write_serving,
)

if TYPE_CHECKING:  # imported when serving starts, after the handshake
    from ranks.shell.frontend import Frontend


def run(ctx: RankContext) -> int:
    if ctx.comm.rank != 0:  # PD: host rank 1 is the decode TE-shell
        return decode_shell.run(ctx)
    started_at, started = datetime.now(), time.perf_counter()
    path = run_file_path(ctx.cfg, started_at)
    handshake_s, status, serving, placements, lost_writer = 0.0, "completed", None, (), None
    ctx.log.info("TE-shell up; waiting for %d ranks", ctx.comm.size - 1)
    try:
        placements = handshake(ctx)
        handshake_s = time.perf_counter() - started
        ctx.log.info(
            "all %d ranks agree on the deployment (%.2f s): %s",
            ctx.comm.size,
            handshake_s,
            ctx.topo.summary(),
        )
        # Lazy import, after the handshake: rank 0's imports delay every rank (docs/scale.md).
        from ranks.shell.frontend import decode_groups

        if decode_groups(ctx.topo):
            serving = Serving(ctx, started=started)
            if serving.mismatches:
                status = f"check failed: {len(serving.mismatches)} mismatches"
    except DecodeDieLost as exc:  # a decode die lost and the run stops: its records
        status, lost_writer = f"failed: {exc}", exc.write_failures
        raise
    except Exception as exc:
        status = f"failed: {exc}"
        raise
    finally:
        if ctx.plan.cluster is not None:  # the JE writes the one run file (ranks/cluster/)
            from ranks.cluster.te_side import send_result

            send_result(ctx, serving, status)
        else:
            write_run_file(
                path,
                cfg=ctx.cfg,
                topo=ctx.topo,
                status=status,
                started_at=started_at,
                wall_time_s=time.perf_counter() - started,
                handshake_s=handshake_s,
                extra=serving.write if serving else lost_writer,
                hosts=[p.host for p in placements],
                nodes=[p.node for p in placements],
            )
            if ctx.cfg.run.trace:
                _write_trace(ctx, path, serving.traces if serving else {})
            ctx.log.info("run %s; run file %s", status.split(":")[0], path.resolve())
            if serving and ctx.cfg.run.check:
                print(serving.check_line, flush=True)
    return 1 if serving and serving.mismatches else 0


def open_endpoint(ctx: RankContext, frontend: Frontend, started: float):
    """serve.enabled: the HTTP endpoint (ranks/shell/endpoint.py) listening, not ready yet,
    fed by `frontend`; it shuts down on a signal or, at the latest, SHUTDOWN_MARGIN before
    run.timeout_s (MPIEXEC_TIMEOUT) would kill the job."""
    # Lazy import, serve only: aiohttp and the API (docs/scale.md).
    from ranks.shell.endpoint import Endpoint, EndpointFeed
    from ranks.shell.openai_api import make_app
    from ranks.shell.serve_metrics import ServeMetrics
    from ranks.shell.serve_records import RecordCap
    from xds_mpi.results.record_cap import max_records

    metrics = ServeMetrics(ctx.cfg.serve.model)
    dp_group_of = {rank: i for i, rank in enumerate(frontend.groups)}
    pd = ctx.plan.pd  # PD: the prefill die's DP group too
    prefill_group_of = {rank: i for i, rank in enumerate(pd.prefill)} if pd else {}
    app = partial(
        make_app,
        cfg=ctx.cfg,
        metrics=metrics,
        dp_group_of=dp_group_of,
        prefill_group_of=prefill_group_of,
    )
    endpoint = Endpoint(ctx.cfg.serve, app, ctx.log)
    endpoint.start()
    timeout_s = ctx.cfg.run.timeout_s
    left = timeout_s - (time.perf_counter() - started) - min(60.0, 0.25 * timeout_s)
    # PD: no cap, the JE's PD book (xds_mpi/pd/results.py) reads every request's record at the end
    cap = RecordCap(ctx.cfg, 0 if ctx.plan.pd else max_records(), ctx.log)
    deadline = time.monotonic() + left
    frontend.attach(EndpointFeed(endpoint, frontend, metrics, deadline=deadline, cap=cap))
    return endpoint


def _resumed(frontend) -> dict[int, float]:
    """Die rank -> when the dies served again after the fence that judged it (wall seconds
    since serving started), for the report's failover timeline."""
    detector = getattr(frontend, "detector", None)
    if detector is None:
        return {}
    return {
        die: detection.resumed_wall - frontend.started
        for detection in detector.detections
        if detection.resumed_wall > 0
        for die in detection.verdicts
    }


def _write_trace(ctx: RankContext, path, traces: dict) -> None:
    """The shell's own events and the ranks' gathered `traces` (as kept) beside the run file."""
    traces = {ctx.comm.rank: trace.take_events()} | {
        rank: trace.as_records(events) for rank, events in traces.items()
    }
    ctx.log.info("trace %s", write_trace(trace_path(path), traces, ctx.topo).resolve())


class Serving:
    """Serve the workload on the DP groups (colocated or attention dies); summarize; check
    against the reference."""

    def __init__(self, ctx: RankContext, *, started: float) -> None:
        with trace.span("serve"):
            frontend = self._serve(ctx, started)
        self.records, self.started = frontend.records, frontend.started
        self.traces = frontend.traces
        self.expert_loads = frontend.expert_loads
        self.admitted = frontend.virtual.admitted if frontend.virtual else {}
        self.failures = with_resumed(frontend.failure_records(), _resumed(frontend))  # §6
        self.summary = summarize(self.records, frontend.started, time.time())
        cap = getattr(frontend.feed, "cap", None)  # serve: the records let go, their check
        self.checked_apart = cap.finish() if cap is not None else None
        if cap is not None and cap.max_records:
            self._add_dropped(cap)
            self.failures = cap.with_rates(self.failures, frontend.started)
        self.summary.update(self.cross_node)
        self.summary["serving_clock"] = ctx.plan.clock.kind
        self.die_timings = {rank: report.timings for rank, report in frontend.reports.items()}
        dropped = sum(report.num_timings_dropped for report in frontend.reports.values())
        if dropped:  # xds-mpi serve --max-iterations
            self.summary["die_iterations_dropped"] = dropped
        self.die_recovery = {rank: report.recovery for rank, report in frontend.reports.items()}
        ctx.log.info(format_summary(self.summary))
        self._add_die_summaries(ctx, frontend.reports)
        self.pd_book = frontend.pd_book  # PD: the TTFT split, KV transfers, EMS hits
        # EMS: the reports of the dies that used the pool (prefill dies with PD, else colocated)
        self.ems_dies = list(self.pd_book.reports.values()) if self.pd_book else []
        if ctx.plan.ems is not None and self.pd_book is None:
            # Lazy import, after the handshake (rank 0's start-up delays every rank); EMS only.
            from xds_mpi.ems.results import ems_summary, format_ems

            self.ems_dies = list(frontend.reports.values())
            self.summary.update(ems_summary(self.ems_dies, frontend.ems_reports.values()))
            ctx.log.info(format_ems(self.summary))
        self._add_slo(ctx)
        self.virtual_times = self._add_virtual(ctx, frontend) if frontend.virtual else None
        if ctx.cfg.serve.enabled:
            self._add_cancellations(ctx, frontend.reports)
        for record in self.failures:
            ctx.log.info(record.describe())
        self.eplb = frontend.eplb.report() if ctx.cfg.eplb.enabled else None
        if self.eplb:
            for line in self.eplb.lines():
                ctx.log.info(line)
            self.summary.update(self.eplb.summary())
        if self.pd_book is not None:
            # Lazy import, after the handshake (rank 0's start-up delays every rank); PD only.
            from xds_mpi.ems.results import format_ems
            from xds_mpi.pd.results import format_pd

            self.summary.update(self.pd_book.summary(self.records, self.started))
            ctx.log.info(format_pd(self.summary))
            if "ems_lookups" in self.summary:
                ctx.log.info(format_ems(self.summary))
        roles = {info.rank: info.role for info in ctx.topo.ranks}
        memory = frontend.memory.records(
            self.records, roles, self.started, time.time()
        )  # §6.2 stage 3
        for record in memory:
            ctx.log.warning(record.describe())
        self.failures = self.failures + memory
        self.mismatches: list[str] = []
        self.check_line = ""
        self.is_checked = ctx.cfg.run.check and ctx.plan.cluster is None  # a cluster: the JE's
        if self.is_checked:
            with trace.span("check"):
                self._check(ctx)

    def _serve(self, ctx: RankContext, started: float) -> Frontend:
        """Serve the whole workload; the Frontend (its records and die reports) once done.
        Freeing the window brings every rank's cross-node traffic (`self.cross_node`)."""
        # Lazy import, after the handshake: rank 0's imports delay every rank (docs/scale.md).
        from ranks.shell.frontend import Frontend
        from ranks.shell.je import JobExecutor

        mem = DieMemory(ctx.comm, 0)  # the shell holds no die memory, but joins the window
        alone = ctx.comm.Split(0, ctx.comm.rank)
        frontend = (JobExecutor if ctx.plan.pd else Frontend)(ctx)
        # a served cluster: the JE hosts the endpoint (ranks/cluster/served_te.py feeds this one)
        is_endpoint = ctx.cfg.serve.enabled and ctx.plan.cluster is None
        endpoint = open_endpoint(ctx, frontend, started) if is_endpoint else None
        await_ready(ctx.comm, ctx.log, started=started, timeout_s=ctx.cfg.run.timeout_s)
        try:  # GET /health is ok once the serving loop starts (Frontend.serve)
            frontend.serve()
        finally:
            if endpoint is not None:
                endpoint.close()
        if not frontend.has_failed_over():
            mem.free()  # collective over every rank: not after a failover (lost dies)
        alone.Free()
        frontend.stop_phases.end("window freed")
        ctx.log.info("stop: %s", frontend.stop_phases.describe())
        total = Traffic()
        for traffic in mem.world_traffic or ():
            total.add(traffic)
        self.cross_node = {
            "cross_node_polls": total.remote_polls,
            "cross_node_rma_ops": total.remote_rma,
            "cross_node_bytes": total.remote_bytes,
        }
        if not all(mem.is_same_node):
            ctx.log.info(
                "cross-node traffic: %d polls through Fetch_and_op, %d RMA operations, %d bytes",
                total.remote_polls,
                total.remote_rma,
                total.remote_bytes,
            )
        return frontend

    def _add_dropped(self, cap) -> None:
        """serve: the totals count the records let go too; the percentiles the kept ones."""
        s = self.summary
        s["num_records_dropped"] = cap.num_dropped
        s["num_requests"] += cap.num_dropped
        s["num_served"] += cap.num_dropped
        s["num_tokens"] += cap.num_dropped_tokens
        s["tokens_per_s"] = s["num_tokens"] / s["wall_s"] if s["wall_s"] > 0 else 0.0

    def _add_die_summaries(self, ctx: RankContext, die_reports: dict) -> None:
        """Log and add to the summary what the dies reported: MTP acceptance and recovery (when
        there was any) and the 910C projection."""
        # Lazy import, after the handshake: rank 0's imports delay every rank (docs/scale.md).
        from xds_mpi.config.hardware import load_profile
        from xds_mpi.model.shapes import cost_shape
        from xds_mpi.results.die_summaries import (
            format_mtp,
            format_projection,
            format_recovery,
            mtp_summary,
            projected_summary,
            recovery_summary,
        )

        mtp = mtp_summary(ctx.cfg.scheduler.mtp_depth, self.die_timings)
        if mtp:
            ctx.log.info(format_mtp(mtp))
            self.summary.update(mtp)
        recovery = recovery_summary(self.die_recovery)
        if recovery:
            ctx.log.info(format_recovery(recovery))
            self.summary.update(recovery)
        big = cost_shape()
        # "per chip" is the profile's chip (an H800 is one die a chip), not the emulated pod's
        # layout (cfg.hardware.dies_per_chip), as `xds-mpi project` counts it
        profile = load_profile(ctx.cfg.hardware.profile)
        dies_per_chip = profile["die"].get("dies_per_chip", 1)
        num_moe_layers = big.num_layers - big.num_dense_layers
        chips = ctx.topo.num_dies / dies_per_chip
        self.summary.update(projected_summary(die_reports, chips, num_moe_layers))
        ctx.log.info(format_projection(self.summary))

    def _add_slo(self, ctx: RankContext) -> None:
        """Log and add the trace replay's numbers (when the workload is a trace) and the SLOs:
        each request priced at its own lengths on the projected clock, and the goodput."""
        # Lazy import, after the handshake: rank 0's imports delay every rank (docs/scale.md).
        from xds_mpi.results.request_pricing import RequestPricer, mean_decode_batch
        from xds_mpi.results.slo import (
            cached_summary,
            format_cached,
            format_slo,
            request_times,
            slo_summary,
        )
        from xds_mpi.workload.trace_replay import format_trace, trace_summary

        if ctx.cfg.workload.source == "trace":
            self.summary.update(trace_summary(ctx.cfg, self.records))
            ctx.log.info(format_trace(self.summary))
        pd = ctx.plan.pd
        num_dies = len(self.die_timings) or ctx.topo.num_dies  # a lost cluster TE reports none
        pricer = RequestPricer(
            ctx.cfg,
            num_prefill_dies=len(pd.tes[0]) if pd else num_dies,
            num_decode_dies=num_dies,
            batch_per_die=mean_decode_batch(self.die_timings),
            is_pd=pd is not None,
        )
        self.slo_times = request_times(self.records, self.started, pricer)
        self.summary.update(slo_summary(ctx.cfg, self.slo_times))
        ctx.log.info(format_slo(self.summary))
        self.cached_times, self.ems_times = [], []
        if ctx.cfg.workload.source == "trace":  # what an EMS pool would make of the hits
            self.cached_times = self._cached_times(ctx, pricer)
            self.summary.update(cached_summary(ctx.cfg, self.cached_times))
            ctx.log.info(format_cached(self.summary))
        if ctx.cfg.workload.source == "trace" and ctx.plan.ems is not None:
            self._add_ems_slo(ctx, pricer)

    def _add_virtual(self, ctx: RankContext, frontend) -> list:
        """run.clock virtual: each request's times on the virtual clock, queueing included, and
        their percentiles and goodput (xds_mpi/results/virtual.py); wall time is the emulator's
        own cost beside them."""
        from xds_mpi.results.virtual import format_virtual, virtual_summary, virtual_times

        times = virtual_times(self.records, frontend.virtual.admitted)
        self.summary.update(virtual_summary(ctx.cfg, times, self.summary["wall_s"]))
        ctx.log.info(format_virtual(self.summary, self.summary["wall_s"]))
        return times

    def _add_ems_slo(self, ctx: RankContext, pricer) -> None:
        """EMS on a trace: each request priced with the prefix the pool really served it (its
        hit blocks at the trace's lengths, pulled over UB), the `ems_` goodput and TTFT keys."""
        # Lazy import, after the handshake (rank 0's start-up delays every rank); EMS only.
        from xds_mpi.ems.results import ems_trace_cached, format_ems_slo
        from xds_mpi.results.slo import cached_summary

        cached = ems_trace_cached(ctx.cfg, self.records, self.ems_dies)
        self.ems_times = self._pulled_times(ctx, pricer, cached)
        summary = cached_summary(ctx.cfg, self.ems_times)
        self.summary.update({"ems_" + k.removeprefix("cache_"): v for k, v in summary.items()})
        ctx.log.info(format_ems_slo(self.summary))

    def _cached_times(self, ctx: RankContext, pricer) -> list:
        """Each request priced with its prefix hits (an unbounded cache of the window) pulled
        over UB from a pool instead of computed."""
        # Lazy import, after the handshake (rank 0's start-up delays every rank); traces only.
        from xds_mpi.workload.trace_replay import cached_prefixes

        return self._pulled_times(ctx, pricer, cached_prefixes(ctx.cfg, self.records))

    def _pulled_times(self, ctx: RankContext, pricer, cached) -> list:
        """Each request priced with its `cached` prefix pulled over UB instead of computed."""
        # Lazy import, after the handshake (rank 0's start-up delays every rank); traces only.
        from xds_mpi.config.hardware import load_profile
        from xds_mpi.results.request_pricing import planes
        from xds_mpi.results.slo import request_times

        ub = planes(load_profile(ctx.cfg.hardware.profile))["UB"]
        return request_times(self.records, self.started, pricer, cached=cached, pool=ub)

    def _add_cancellations(self, ctx: RankContext, die_reports: dict) -> None:
        """serve: requests ended early (client gone, stop string, shutdown), and what the dies
        say they dropped and freed."""
        ended = [r for r in self.records.values() if r.cancelled and not r.rejected]
        on_dies = {
            key: sum(report.cancelled.get(key, 0) for report in die_reports.values())
            for key in ("requests", "kv_blocks_freed")
        }
        self.summary.update(
            num_cancelled=len(ended),
            num_cancelled_on_dies=on_dies["requests"],
            cancelled_kv_blocks_freed=on_dies["kv_blocks_freed"],
        )
        reasons = Counter(r.cancelled for r in ended)
        ctx.log.info(
            "serve: %d requests ended early (%s); the dies dropped %d of them and freed %d KV "
            "blocks (the others had finished or not reached a die)",
            len(ended),
            ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) or "none",
            on_dies["requests"],
            on_dies["kv_blocks_freed"],
        )

    def _check(self, ctx: RankContext) -> None:
        """Compare every served request with the single-process reference; log each mismatch."""
        ctx.log.info(
            "check: running the single-process reference on %d requests", len(self.records)
        )
        checked = time.perf_counter()
        num_requests, num_tokens, self.mismatches = check_against_reference(ctx.cfg, self.records)
        if self.checked_apart is not None:  # serve: the records let go, checked as they went
            num_requests += self.checked_apart.num_requests
            num_tokens += self.checked_apart.num_tokens
            self.mismatches = self.checked_apart.mismatches + self.mismatches
        ctx.log.info("check: reference done in %.1f s", time.perf_counter() - checked)
        for line in self.mismatches:
            ctx.log.error("check: %s", line)
        self.check_line = (
            f"check: {num_requests} requests, {num_tokens} tokens, "
            f"{len(self.mismatches)} mismatches"
        )
        cancelled = sum(1 for r in self.records.values() if r.cancelled and not r.rejected)
        if cancelled:  # serve: ended early; their tokens are the reference's first ones
            self.check_line += f"; {cancelled} of them ended early, compared as prefixes"
        lost = sorted(r for r, record in self.records.items() if record.lost)
        if lost:  # not checked: their KV went with a memory fault (ranks/recovery/memory.py)
            self.check_line += f"; {len(lost)} lost, not checked: {lost}"

    def write(self, f) -> None:
        write_serving(
            f, self.records, self.started, self.summary, self.die_timings, self.die_recovery
        )
        f["summary"].attrs["check_mismatches"] = len(self.mismatches) if self.is_checked else -1
        # Lazy import, after the handshake: rank 0's imports before it delay every rank.
        from xds_mpi.results.slo import write_slo

        write_slo(f, self.slo_times, self.cached_times, self.ems_times)
        if self.virtual_times is not None:
            from xds_mpi.results.virtual import write_virtual

            write_virtual(f, self.virtual_times)
        if self.eplb:
            self.eplb.write(f)
        failures = self.failures + (self.pd_book.failures if self.pd_book is not None else [])
        if failures:
            write_failures(f, failures)
        if self.pd_book is not None:
            self.pd_book.write(f, self.records, self.started)
        if self.expert_loads:
            # Lazy import, after the handshake (rank 0's start-up delays every rank); afd only.
            from xds_mpi.afd.load import write_loads

            write_loads(f, self.expert_loads)
