"""`xds-mpi serve` on a cluster (docs/serve.md, "A cluster"): the JE (world rank 0) hosts the
OpenAI endpoint and routes each request to a TE at once, on the wall clock.

The endpoint's serving loop (ranks/shell/endpoint.py EndpointFeed) drives a `ServedCluster` as
a lone TE-shell's drives its Frontend (admit, cancel, records, num_open, touched, queue, ...):

Step 1: admit: the JE's policy (cluster.policy, xds_mpi/cluster/loads.py TeLoads, now = wall
  seconds since serving started) picks a TE, and the request goes to its TE-shell
  (ranks/cluster/served_te.py) in the turn's `Commands`; a cancel goes the same way.
Step 2: each TE-shell's news (its requests' new tokens, readiness, failover, gauges) is applied
  to the JE's records, so the endpoint streams every TE's tokens; a finish is the loads'
  completion. /health: 200 once every TE is ready, 503 while any fails over.
A lost TE (cluster.te_losses, at_s in wall seconds since every TE serves): the JE takes none of
  its news from at_s on (its clients see no more tokens from it), finds it lost
  health.timeout_s + health.dp_interval_s later (as a TE-shell finds a silent die), routes no
  request there any more and routes each of its open requests again to another TE, which serves
  it from its prompt; the tokens the client already has are not streamed twice (each is
  compared with the new TE's). The lost TE's ranks run on for nothing (told to drop those
  requests) until the shutdown.
Step 3: shutdown as a lone TE-shell's (drain or cancel), then every TE-shell is told to stop;
  each stops its dies and sends its records (`TeResult`), and the JE writes the one run file
  and checks every request against the reference, whichever TE served it.

Every wait is bounded: the TEs' readiness and their results within run.timeout_s, the serving
loop by the endpoint's deadline (errors naming the TEs and what is missing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial

from mpi4py import MPI

from ranks.cluster.je_parts import (
    check_every_request,
    cluster_loads,
    count_per_te,
    run_job,
    write_own_files,
    write_te_columns,
)
from ranks.cluster.messages import TAG_CLUSTER_RESULT, TeResult
from ranks.cluster.serve_messages import (
    TAG_CLUSTER_NEWS,
    TAG_CLUSTER_SERVE,
    Admit,
    Commands,
    TeGauges,
    TeNews,
)
from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, wait_all
from ranks.shell.endpoint import Endpoint, EndpointFeed
from ranks.shell.openai_api import make_app
from ranks.shell.serve_metrics import ServeMetrics
from xds_mpi.plan.cluster import te_config
from xds_mpi.plan.topology import Topology
from xds_mpi.results.results import RequestRecord
from xds_mpi.workload.requests import rejection

# The loop's pause while no work comes, as a TE-shell's (ranks/shell/frontend.py).
IDLE_FIRST_S, IDLE_LAST_S = 0.0005, 0.002


def run(ctx: RankContext) -> int:
    """The served JE's program; ctx.comm is the link (JE 0, TE-shell of TE k at k + 1)."""

    def serve(cluster: ServedCluster, started: float) -> None:
        endpoint, feed = open_endpoint(ctx, cluster, started)
        try:
            cluster.serve(feed)
        finally:
            endpoint.close()
        cluster.stop_tes()
        cluster.collect()

    return run_job(ctx, ServedCluster, serve, what="JE up, serving")


def open_endpoint(ctx: RankContext, cluster: ServedCluster, started: float):
    """The endpoint on the JE, fed by `cluster`; it shuts down on a signal or, at the latest, a
    margin before run.timeout_s, as a lone TE-shell's (ranks/shell/te_shell.py)."""
    metrics = ServeMetrics(ctx.cfg.serve.model)
    metrics.add_te_series()
    app = partial(
        make_app,
        cfg=ctx.cfg,
        metrics=metrics,
        dp_group_of=cluster.dp_group_of,
        prefill_group_of={},
    )
    endpoint = Endpoint(ctx.cfg.serve, app, ctx.log)
    endpoint.start()
    timeout_s = ctx.cfg.run.timeout_s
    left = timeout_s - (time.perf_counter() - started) - min(60.0, 0.25 * timeout_s)
    cluster.metrics = metrics
    return endpoint, EndpointFeed(endpoint, cluster, metrics, deadline=time.monotonic() + left)


@dataclass(kw_only=True)
class FailoverLog:
    """The failures the TEs' heartbeats found, as EndpointFeed counts a Frontend's detector's
    (one entry per detection: its TE)."""

    detections: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class ClusterKv:
    """The TEs' KV books as EndpointFeed reads a balancer's: groups (die world ranks), a
    group's mean capacity, and the tokens reserved per group, so that reserved over
    capacity x groups is the cluster's usage."""

    groups: tuple[int, ...] = ()
    capacity: float = 1.0
    reserved: dict[int, int] = field(default_factory=dict)


class ServedCluster:
    """The JE's side of the endpoint: the TEs behind it as one frontend (EndpointFeed's)."""

    def __init__(self, ctx: RankContext) -> None:
        cfg, cluster = ctx.cfg, ctx.plan.cluster
        self.ctx, self.cfg, self.cluster = ctx, cfg, cluster
        self.comm, self.log = ctx.comm, ctx.log
        self.records: dict[int, RequestRecord] = {}
        self.touched: set[int] = set()  # requests with news for the endpoint this turn
        self.num_open = 0  # admitted, not finished
        self.started = time.time()  # from serve(): arrivals are seconds since then
        self.loads = cluster_loads(cfg, cluster, None, lambda req: req.arrival_s)
        self.routed_s: dict[int, float] = {}  # req_id -> the routing, wall s since started
        self.outbox = {te: Commands() for te in range(cluster.num_tes)}
        self.sends: list[MPI.Request] = []
        self.gauges: dict[int, TeGauges] = {}  # TE -> its last gauges
        self.is_te_ready: set[int] = set()
        self.is_te_failing_over: set[int] = set()
        self.num_detections = [0] * cluster.num_tes
        self.detector = FailoverLog()
        self.balancer = ClusterKv()
        self.dp_group_of = {}  # die world rank -> its DP group inside its TE
        self.kv_capacity = {}  # TE -> a DP group's KV tokens
        for t in cluster.tes:
            topo = Topology.from_config(te_config(cfg, t.overrides), None)
            groups = topo.ranks_with_role("colocated") + topo.ranks_with_role("attention")
            self.dp_group_of.update({t.first_rank + g: i for i, g in enumerate(groups)})
        self.metrics: ServeMetrics | None = None  # open_endpoint's
        # lost TEs: wall s since every TE serves (`serving_at`); found detect_s later
        self.lost_at = {loss.te: loss.at_s for loss in cfg.cluster.te_losses}
        self.detect_s = cfg.health.timeout_s + cfg.health.dp_interval_s
        self.found_at: dict[int, float] = {}  # TE -> found lost (wall s since serving_at)
        self.serving_at = 0.0  # time.time() when every TE served (0: not yet)
        self.orphaned: dict[int, int] = {}  # req_id -> the lost TE it was first routed to
        self.streamed: dict[int, int] = {}  # req_id routed again -> tokens its client had then
        self.rerouted_mismatches: list[str] = []
        self.results: dict[int, TeResult] = {}
        self.mismatches: list[str] = []
        self.check_line = self.te_failure = ""

    # -- EndpointFeed's frontend ------------------------------------------------------------

    @property
    def queue(self) -> list[int]:
        """The requests queued in the TE-shells (not on a die), as they last reported."""
        return [req_id for gauges in self.gauges.values() for req_id in gauges.queued]

    def admit(self, req, arrived_at: float) -> None:
        """Step 1: a request from the endpoint, to the TE the policy picks now."""
        req = replace(req, arrival_s=arrived_at - self.started)
        reason = rejection(req, self.cfg)
        self.records[req.req_id] = RequestRecord(req=req, rejected=reason)
        if reason:  # the endpoint checks first; this one is the last word
            self.records[req.req_id].cancelled = f"rejected: {reason}"
            self.touched.add(req.req_id)
            return
        te = self.loads.pick(req)
        self.loads.on_dispatch(te, req)
        self.routed_s[req.req_id] = req.arrival_s
        box = self.outbox[te]
        self.outbox[te] = replace(box, admits=(*box.admits, Admit(req=req, arrived_at=arrived_at)))
        self.num_open += 1

    def cancel(self, req_id: int, reason: str) -> None:
        """End an open request now: its TE-shell drops it (out of its queue or off its die)."""
        record = self.records[req_id]
        if record.finished_at or record.rejected:
            return  # finished before the cancel came
        te = self.loads.te_of[req_id]
        self.loads.on_complete(req_id)
        box = self.outbox[te]
        self.outbox[te] = replace(box, cancels=(*box.cancels, (req_id, reason)))
        record.cancelled, record.finished_at = reason, time.time()
        self.num_open -= 1
        self.touched.add(req_id)

    def open_requests(self) -> list[int]:
        return [r for r, rec in self.records.items() if not (rec.finished_at or rec.rejected)]

    def projected_times(self, req_id: int) -> tuple[float, float]:
        record = self.records[req_id]
        return record.projected_ttft_s(), record.projected_tpot_s()

    def prefill_rank(self, req_id: int) -> int:
        return -1

    # -- the serving loop -------------------------------------------------------------------

    def serve(self, feed: EndpointFeed) -> None:
        """Until the endpoint closed (shutdown drained or cancelled every request); GET /health
        200 once every TE is ready, 503 while one fails over."""
        self.started = time.time()
        ready_by = time.monotonic() + self.cfg.run.timeout_s
        is_ready = is_failing_over = False
        idle_s = 0.0
        while feed.is_open:
            did_work = self.turn() + feed.turn()
            if not is_ready and len(self.is_te_ready) == self.cluster.num_tes:
                is_ready = True
                self.serving_at = time.time()
                feed.ready()
                self.log.info("JE: every TE serves (%d)", self.cluster.num_tes)
            if is_ready:
                did_work += self._find_losses()
            if not is_ready and time.monotonic() > ready_by:
                waiting = sorted(set(range(self.cluster.num_tes)) - self.is_te_ready)
                raise WaitTimeout(
                    f"JE: no ready news from TEs {waiting} (TE-shells at world ranks "
                    f"{[self.cluster.first_rank(te) for te in waiting]}) after run.timeout_s"
                    f"({self.cfg.run.timeout_s:g})"
                )
            if is_failing_over != bool(self.is_te_failing_over):
                is_failing_over = bool(self.is_te_failing_over)
                feed.failing_over(is_failing_over)
            self._measure()
            if did_work:
                idle_s = 0.0
            else:
                idle_s = min(2 * idle_s, IDLE_LAST_S) if idle_s else IDLE_FIRST_S
                time.sleep(idle_s)
        self.ended = time.time()

    def turn(self) -> int:
        """Step 2: the TEs' news applied; Step 1's commands sent."""
        num = 0
        while (
            message := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_CLUSTER_NEWS)
        ) is not None:
            self._apply(message.recv())
            num += 1
        return num + self._flush()

    def _is_lost(self, te: int) -> bool:
        """TE `te` is lost by now (its news no longer counts)."""
        at_s = self.lost_at.get(te)
        return at_s is not None and self.serving_at and time.time() - self.serving_at >= at_s

    def _find_losses(self) -> int:
        """A lost TE found (health.timeout_s + dp_interval_s after its loss): no candidate any
        more, its open requests routed again, told to drop them."""
        num, now_s = 0, time.time() - self.serving_at
        for te, at_s in sorted(self.lost_at.items()):
            if te in self.found_at or now_s < at_s + self.detect_s:
                continue
            self.found_at[te] = now_s
            self.loads.lost.add(te)
            self.is_te_failing_over.discard(te)
            orphans = [r for r in self.open_requests() if self.loads.te_of.get(r) == te]
            for req_id in orphans:
                record = self.records[req_id]
                self.loads.on_complete(req_id)  # off the lost TE's load
                self.orphaned[req_id] = te
                self.streamed[req_id] = len(record.tokens)
                new = self.loads.pick(record.req)
                self.loads.on_dispatch(new, record.req)
                box = self.outbox[new]
                arrived_at = self.started + record.req.arrival_s
                admit = Admit(req=record.req, arrived_at=arrived_at)
                self.outbox[new] = replace(box, admits=(*box.admits, admit))
            box = self.outbox[te]
            cancels = tuple((r, "its TE was lost") for r in orphans)
            self.outbox[te] = replace(box, cancels=(*box.cancels, *cancels))
            if self.metrics is not None:
                self.metrics.te_lost.labels(str(te)).set(1)
            self.log.warning(
                "JE: TE %d lost at %.3f s, found at %.3f s (wall, since every TE served): %d open "
                "requests routed again (%s)",
                te,
                at_s,
                now_s,
                len(orphans),
                orphans,
            )
            num += 1
        return num

    def _flush(self) -> int:
        num = 0
        for te, commands in self.outbox.items():
            if commands == Commands():
                continue
            shell = self.cluster.shell(te)  # on the link
            self.sends.append(self.comm.isend(commands, dest=shell, tag=TAG_CLUSTER_SERVE))
            self.outbox[te] = Commands()
            num += 1
        if num:
            self.sends = [r for r in self.sends if not r.Test()]
        return num

    def _apply(self, news: TeNews) -> None:
        te, first = news.te, self.cluster.first_rank(news.te)
        if self._is_lost(te):
            return  # nothing it sends counts from its loss on
        if news.is_ready:
            self.is_te_ready.add(te)
        if news.is_failing_over:
            self.is_te_failing_over.add(te)
        else:
            self.is_te_failing_over.discard(te)
        new_detections = news.num_detections - self.num_detections[te]
        self.detector.detections += [te] * new_detections
        self.num_detections[te] = news.num_detections
        self.gauges[te] = news.gauges
        for batch in news.batches:
            self._observe(first + batch.die_rank, batch)
        for update in news.requests:
            record = self.records[update.req_id]
            if update.die_rank >= 0:
                record.die_rank = first + update.die_rank
                record.dispatched_vtime = update.dispatched_vtime
            if update.finished_at and not update.ended and self.metrics is not None:
                self.metrics.te_finished.labels(str(te)).inc()  # its TE served it to its end
            if record.finished_at or record.rejected:
                continue  # cancelled here before: its client has gone
            if self.loads.te_of.get(update.req_id) != te:
                continue  # routed again from this TE (lost before)
            for token, wall_s, vtime_s in zip(
                update.tokens, update.token_times, update.token_vtimes, strict=True
            ):
                self._add_token(record, token, wall_s, vtime_s)
            self.touched.add(update.req_id)
            if update.finished_at or update.ended:
                record.cancelled = update.ended
                record.finished_at = update.finished_at or time.time()
                self.loads.on_complete(update.req_id)
                self.num_open -= 1

    def _add_token(self, record: RequestRecord, token: int, wall_s: float, vtime_s: float) -> None:
        """A token for the client, but for a request routed again the ones its client had: each
        compared with the new TE's (the served model is deterministic)."""
        req_id, streamed = record.req.req_id, self.streamed.get(record.req.req_id, 0)
        if streamed:
            index = len(record.tokens) - streamed  # the new TE's token index
            if record.tokens[index] != token:
                self.rerouted_mismatches.append(
                    f"request {req_id}: token {index} was {record.tokens[index]} on the lost TE, "
                    f"{token} on TE {self.loads.te_of[req_id]}"
                )
            self.streamed[req_id] = streamed - 1
            return
        record.add_token(token, wall_s, vtime_s)

    def _observe(self, die: int, batch) -> None:
        """A TE's token batch on the per-die histograms and the MTP counters."""
        m = self.metrics
        if m is None:
            return
        m.iteration.labels(str(die)).observe(batch.iteration_s)
        m.xccl.labels(str(die)).observe(batch.xccl_s)
        m.draft_tokens.inc(batch.num_drafts)
        m.accepted_tokens.inc(batch.num_accepted)

    def _measure(self) -> None:
        """The KV book EndpointFeed reads, and the per-TE series."""
        groups, reserved, capacity = [], {}, 0
        for te, gauges in sorted(self.gauges.items()):
            first = self.cluster.first_rank(te)
            groups += [first + g for g in gauges.groups]
            reserved |= {first + g: n for g, n in zip(gauges.groups, gauges.kv_reserved)}
            capacity += gauges.kv_capacity * len(gauges.groups)
            if self.metrics is not None:
                label = str(te)
                self.metrics.te_running.labels(label).set(gauges.num_open - len(gauges.queued))
                self.metrics.te_waiting.labels(label).set(len(gauges.queued))
                self.metrics.te_kv_usage.labels(label).set(
                    sum(gauges.kv_reserved) / max(gauges.kv_capacity * len(gauges.groups), 1)
                )
                self.metrics.te_failing_over.labels(label).set(te in self.is_te_failing_over)
        if groups:  # before the first gauges: the empty book (usage 0)
            self.balancer = ClusterKv(
                groups=tuple(groups), capacity=capacity / len(groups), reserved=reserved
            )

    # -- the end ----------------------------------------------------------------------------

    def stop_tes(self) -> None:
        """Step 3: every TE-shell told to stop (after the cancels still to send)."""
        for te, box in self.outbox.items():
            self.outbox[te] = replace(box, shutdown=True)
        self._flush()
        self.log.info("JE: serving done, stopping the %d TEs", self.cluster.num_tes)

    def collect(self) -> None:
        """Every TE's TeResult (bounded; news still on its way is taken and let go), merged:
        each TE's records (its die ranks made world ranks) under the JE's requests, whose
        arrivals count from the JE's start."""
        cfg, cluster = self.cfg, self.cluster
        left_s = max(cfg.run.timeout_s - (time.time() - self.started), cfg.xccl.poll_timeout_s)
        deadline, status = time.monotonic() + left_s, MPI.Status()
        while len(self.results) < cluster.num_tes:
            if self.comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                message = self.comm.recv(source=status.source, tag=status.tag)
                if status.tag == TAG_CLUSTER_RESULT:
                    self.results[message.te] = message
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(cluster.num_tes)) - set(self.results))
                raise WaitTimeout(
                    f"JE: TE result not received from TEs {missing} (TE-shells at world ranks "
                    f"{[cluster.first_rank(te) for te in missing]}) after {left_s:g} s"
                )
            time.sleep(IDLE_LAST_S)
        wait_all(self.sends, timeout_s=cfg.xccl.poll_timeout_s, me="JE", event="commands")
        self.die_timings: dict[int, dict] = {}
        for te, result in sorted(self.results.items()):
            first = cluster.first_rank(te)
            if result.status != "completed" and not self.te_failure:
                self.te_failure = f"failed: TE {te}: {result.status}"
            for req_id, record in result.records.items():
                if self.orphaned.get(req_id) == te:
                    continue  # lost with its TE, served again elsewhere
                record.die_rank = first + record.die_rank if record.die_rank >= 0 else -1
                seen = self.records[req_id]
                record.req = seen.req  # its arrival from the JE's start
                if req_id in self.orphaned and len(seen.tokens) == len(record.tokens):
                    record.token_times = seen.token_times  # when its client had each token
                self.records[req_id] = record
            self.die_timings.update({first + r: t for r, t in result.die_timings.items()})
        self._summarize()

    def _summarize(self) -> None:
        from xds_mpi.results.results import format_summary, summarize

        cluster = self.cluster
        self.summary = summarize(self.records, self.started, self.ended)
        self.summary["serving_clock"] = self.ctx.plan.clock.kind
        self.summary.update(num_tes=cluster.num_tes, cluster_policy=cluster.policy)
        self.summary["rerouted_requests"] = len(self.orphaned)
        for key in ("num_cancelled", "num_cancelled_on_dies", "cancelled_kv_blocks_freed"):
            self.summary[key] = sum(r.summary.get(key, 0) for r in self.results.values())
        self.log.info(format_summary(self.summary))
        count_per_te(self.summary, cluster, self.loads.te_of, self.log)
        self.log.info(
            "serve: %d requests ended early; the dies dropped %d of them and freed %d KV blocks",
            self.summary["num_cancelled"],
            self.summary["num_cancelled_on_dies"],
            self.summary["cancelled_kv_blocks_freed"],
        )

    def check(self) -> None:
        """Every request against the single-process reference, whichever TE served it."""
        self.mismatches, self.check_line = check_every_request(self.cfg, self.records, self.log)
        for line in self.rerouted_mismatches:  # a token streamed twice that differed
            self.log.error("check: %s", line)
        if self.rerouted_mismatches:
            self.mismatches += self.rerouted_mismatches
            differed = len(self.rerouted_mismatches)
            self.check_line += f"; {differed} tokens differed when routed again"
        ended = sum(1 for r in self.records.values() if r.cancelled and not r.rejected)
        if ended:  # their tokens are the reference's first ones
            self.check_line += f"; {ended} of them ended early, compared as prefixes"

    def write(self, f) -> None:
        """/requests, /dies (world ranks), /summary as a lone TE-shell's run file has them, and
        /cluster: each request's TE and routing (wall s), the TEs, the decision log."""
        import numpy as np

        from xds_mpi.cluster.decisions import write_decisions
        from xds_mpi.results.results import write_serving

        cluster = self.cluster
        write_serving(f, self.records, self.started, self.summary, self.die_timings)
        f["summary"].attrs["check_mismatches"] = len(self.mismatches) if self.cfg.run.check else -1
        f.attrs["world_size"] = cluster.world_size
        group = f.create_group("cluster")
        ids = sorted(self.records)
        group["req_id"] = np.array(ids, np.int64)
        group["te"] = np.array([self.loads.te_of.get(r, -1) for r in ids], np.int64)
        group["routed_s"] = np.array([self.routed_s.get(r, np.nan) for r in ids])
        group["first_te"] = np.array(
            [self.orphaned.get(r, self.loads.te_of.get(r, -1)) for r in ids], np.int64
        )
        num_tes = cluster.num_tes
        group["te_lost_s"] = np.array([self.lost_at.get(te, np.nan) for te in range(num_tes)])
        group["te_found_s"] = np.array([self.found_at.get(te, np.nan) for te in range(num_tes)])
        write_te_columns(group, cluster, [self._status(te) for te in sorted(self.results)])
        write_own_files(group, self.results)
        write_decisions(group, self.loads.decisions)

    def _status(self, te: int) -> str:
        found_s = self.found_at.get(te)
        if found_s is None:
            return self.results[te].status
        return f"lost at {self.lost_at[te]:g} s, found at {found_s:.3f} s (wall, since serving)"
