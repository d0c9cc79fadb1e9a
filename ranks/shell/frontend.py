"""The TE-shell's frontend: admits the workload, dispatches each request once to a DP group with
the decode load balancer (xDeepServe §4.3), and takes the tokens the dies stream back."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import replace

from mpi4py import MPI

from ranks.afd.load_io import gather_loads
from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, recv_from_each, send_to_each, wait_all
from ranks.core.messages import (
    TAG_CANCEL,
    TAG_REPORT,
    TAG_REQUEST,
    TAG_STOP,
    TAG_TOKENS,
    DieReport,
)
from ranks.core.tags import TAG_EMS_REPORT
from ranks.core.trace_io import gather_traces
from ranks.recovery.detector import DecodeDieLost, Detector, static_placement
from ranks.recovery.memory import MemoryLosses
from ranks.recovery.scale_down import scale_down
from ranks.recovery.watch import is_watched, watch_comm, watcher
from ranks.shell.eplb import make_eplb_shell
from xds_mpi.report import trace
from xds_mpi.report.progress import Phases, Progress, Snapshot
from xds_mpi.results.results import RequestRecord
from xds_mpi.scheduling.balancer import DecodeBalancer
from xds_mpi.workload.requests import rejection
from xds_mpi.workload.stream import load_workload


def decode_groups(topo) -> tuple[int, ...]:
    """The DP groups requests go to: the colocated dies, or the attention dies (afd)."""
    return topo.ranks_with_role("colocated") + topo.ranks_with_role("attention")


# The TE-shell's pause while no work comes: from IDLE_FIRST_S doubling to IDLE_LAST_S, none after
# a turn with work, never past the next request's arrival. A die's iteration takes 20 ms or more,
# so taking its tokens up to 2 ms late costs nothing (they carry the die's time), while a fixed
# 0.5 ms pause took 60 of the 950 ms of CPU the main job's 5 ranks have in its 0.47 s of serving.
IDLE_FIRST_S, IDLE_LAST_S = 0.0005, 0.002
# The heartbeats (§6.1) are looked after WATCH_SHARE times per heartbeat interval, not every
# turn: a ping due or an answer taken a twentieth of the interval late changes nothing (a die is
# suspected after seconds), while a look each of the ~340 turns of the main job cost the
# TE-shell ~25 us each.
WATCH_SHARE = 20


class Frontend:
    virtual = None  # run.clock virtual: the VirtualPacer (ranks/shell/virtual_time.py)
    lost_for_good: DecodeDieLost | None = None  # a cluster's TE whose dies could not go on

    def __init__(self, ctx: RankContext) -> None:
        cfg = ctx.cfg
        self.ctx, self.comm, self.log = ctx, ctx.comm, ctx.log
        self.groups = decode_groups(ctx.topo)
        self.records: dict[int, RequestRecord] = {}
        self.queue: deque = deque()
        # With serve.enabled the requests come from the HTTP endpoint (ranks/shell/endpoint.py)
        # instead of the workload section, until shutdown.
        self.feed = None
        self.touched: set[int] = set()  # requests with news for the endpoint this turn
        self.vclock_of: dict[int, float] = {}  # die rank -> its virtual clock, last batch
        fed = cfg.serve.enabled or ctx.plan.cluster is not None  # a cluster: the JE routes
        for req in () if fed else load_workload(cfg):
            reason = rejection(req, cfg)
            self.records[req.req_id] = RequestRecord(req=req, rejected=reason)
            if reason:
                self.log.warning("request %d rejected: %s", req.req_id, reason)
            else:
                self.queue.append(req)
        self.queue = deque(sorted(self.queue, key=lambda r: (r.arrival_s, r.req_id)))
        sched = cfg.scheduler
        self.balancer = DecodeBalancer(
            self.groups,
            max_batch=sched.max_batch_per_die,
            kv_capacity_tokens=sched.num_kv_blocks_per_die * sched.kv_block_tokens,
            block_tokens=sched.kv_block_tokens,
            mtp_depth=sched.mtp_depth,
        )
        self.num_open = len(self.queue)
        self.batches_from: Counter[int] = Counter()  # die rank -> token batches taken
        self.lost: tuple[int, ...] = ()  # DP groups scaled away (ranks/recovery/scale_down.py)
        # §6.1: heartbeats to every DP master (before the EPLB side: the same order as the dies)
        self.detector = None
        if is_watched(cfg, ctx.plan) and watcher(ctx.plan) == ctx.comm.rank:  # PD: rank 1 watches
            self.detector = Detector(ctx, self.groups, self._placement, watch_comm(ctx))
        self.watch_every_s = cfg.health.dp_interval_s / WATCH_SHARE
        self.sends: list[MPI.Request] = []
        self.reports: dict[int, DieReport] = {}
        self.eplb = make_eplb_shell(ctx, self.groups)  # §4.5: counts in, placements out
        self.traces: dict[int, list] = {}  # rank -> its trace events (ranks/core/trace_io.py)
        self.expert_loads: dict = {}  # afd: expert rank -> ExpertLoad (ranks/afd/load_io.py)
        self.memory = MemoryLosses(ctx.comm, ctx.log)  # KV memory faults (§6.2 stage 3)
        self.pd_book = None  # PD: the TTFT split and KV transfers (ranks/shell/je.py)
        self.ems_reports: dict = {}  # colocated with ems.enabled: pool rank -> EmsPoolReport
        ctx.log.info("serving clock: %s (%s)", ctx.plan.clock.kind, ctx.plan.clock.why)
        if ctx.plan.cluster is not None and cfg.serve.enabled:  # the JE's endpoint, wall clock
            from ranks.cluster.link import cluster_link
            from ranks.cluster.served_te import ServedTeFeed

            self.feed = ServedTeFeed(self, cluster_link())
        elif ctx.plan.cluster is not None and not ctx.plan.pd:  # requests from the cluster's JE
            from ranks.cluster.link import cluster_link
            from ranks.cluster.te_side import TePacer

            self.virtual = TePacer(self, cluster_link())
            self.feed = self.virtual.feed
        elif ctx.plan.clock.is_virtual and not ctx.plan.pd:  # PD: the JE's (ranks/shell/je.py)
            from ranks.shell.virtual_time import VirtualPacer

            self.virtual = VirtualPacer(self)

    def serve(self) -> None:
        """Until every accepted request is finished; then tell the dies to stop."""
        self.started = time.time()
        deadline = time.monotonic() + self.ctx.cfg.run.timeout_s
        progress = Progress(self.log)
        idle_s = 0.0  # the loop's pause while no work comes (IDLE_FIRST_S ... IDLE_LAST_S)
        watch_at = 0.0  # time.monotonic() of the next look at the heartbeats
        if self.feed is not None:
            self.feed.ready()  # every die up (PD: the prefill dies too): GET /health ok
        while self.num_open or (self.feed is not None and self.feed.is_open):
            did_work = self._dispatch_arrived() + self.take_tokens() + self.eplb.poll()
            did_work += self._end_lost()
            if self.feed is not None:
                did_work += self.feed.turn()  # endpoint requests in, their tokens out
            if self.detector is not None and time.monotonic() >= watch_at:
                did_work += self._watch_dies()
                watch_at = time.monotonic() + self.watch_every_s
            if progress.is_due():
                progress.show(self.progress())
            if time.monotonic() > deadline and self.feed is None:
                raise WaitTimeout(
                    f"TE-shell: {self.num_open} requests unfinished after "
                    f"run.timeout_s({self.ctx.cfg.run.timeout_s:g})"
                )
            if did_work:
                idle_s = 0.0
            else:
                idle_s = min(2 * idle_s, IDLE_LAST_S) if idle_s else IDLE_FIRST_S
                time.sleep(min(idle_s, self._until_next_arrival()))
        progress.close()
        self._finish()

    def _until_next_arrival(self) -> float:
        """Seconds until the next queued request arrives (0 when one waits already, inf when
        none is queued)."""
        if not self.queue or self.virtual is not None:  # virtual: no wall time to wait for
            return float("inf")
        return max(0.0, self.queue[0].arrival_s - (time.time() - self.started))

    def _watch_dies(self) -> int:
        """§6.1-6.2: heartbeats; on silence, fence, judge and scale down. GET /health answers
        503 from the fence until the survivors serve again."""
        silent = self.detector.silent_dies()
        if not silent:
            return 0
        if self.feed is not None:
            self.feed.failing_over(True)
        try:
            loss = self.detector.fence(silent, self.records, self.started)
        except DecodeDieLost as exc:
            if not getattr(self.virtual, "lost", None):  # not a cluster's TE: the run stops
                raise
            self._lose_te(exc)
            return 1
        scale_down(self, loss)  # §6.2 stage 2: the dies go on without the lost ones
        if self.feed is not None:
            self.feed.failing_over(False)
        return 1

    def _lose_te(self, exc: DecodeDieLost) -> None:
        """A cluster's TE whose dies cannot go on (docs/cluster.md "A lost TE"): the last tokens
        taken, the JEs told the loss's virtual time (the fault's) and the finishes before it,
        every die stopped (each leaves as a lost die does, no collective); the serving loop
        ends, and the TE's records go to the JE, which routes the unfinished requests again."""
        while self.take_tokens():
            pass
        began = [n.virtual_s for n in self.detector.began.values() if n.virtual_s == n.virtual_s]
        at_s = min(began) if began else self.virtual.decided_s
        self.log.warning("TE lost at %.3f s virtual: %s", at_s, exc)
        self.virtual.lost(at_s, str(exc))
        self.lost_for_good = exc
        dies = self.ctx.topo.die_ranks  # the dead one too: each leaves on its stop
        self.sends += [self.comm.isend(None, dest=d, tag=TAG_STOP) for d in dies]
        self.queue.clear()
        self.num_open = 0

    def _finish(self) -> None:
        """Stop every die (the lost ones too, so that they leave), take the reports, traces and
        last tokens; `stop_phases` says how long each took."""
        timeout_s = self.ctx.cfg.xccl.poll_timeout_s
        if self.lost_for_good is not None:  # every die told to leave (`_lose_te`): no report
            self.stop_phases = Phases()
            self.reports, self.traces, self.expert_loads = {}, {}, {}
            wait_all(self.sends, timeout_s=timeout_s, me="TE-shell", event="stop of a lost TE")
            return
        lost = self.lost_dies()  # told too, so that they leave (without a collective)
        self.ctx.log.info("serving done: stopping %d dies, taking their reports", len(self.groups))
        phases = self.stop_phases = Phases()
        send_to_each(
            self.comm,
            {g: None for g in self.groups + lost},
            tag=TAG_STOP,
            timeout_s=timeout_s,
            me="TE-shell",
            event="stop",
        )
        phases.end("stop taken")
        self.reports = recv_from_each(
            self.comm,
            self.groups,
            tag=TAG_REPORT,
            timeout_s=timeout_s,
            me="TE-shell",
            event="die report",
            log=self.ctx.log,  # a line every 2 s: at pod width the reports take a while
        )
        ems = self.ctx.plan.ems
        if ems is not None and not self.ctx.plan.pd:  # once every colocated die closed its client
            self.ems_reports = recv_from_each(
                self.comm,
                ems.pool,
                tag=TAG_EMS_REPORT,
                timeout_s=timeout_s,
                me="TE-shell",
                event="EMS pool report",
            )
        if self.virtual is not None:  # the admissions the dies' last clock reports carry
            self.virtual.finish(timeout_s)
        phases.end("reports")
        self.traces = gather_traces(
            self.comm, self.ctx.topo, timeout_s=timeout_s, skip=lost, log=self.ctx.log
        )
        if not self.ctx.plan.pd:  # PD's expert dies keep theirs (ranks/afd/expert.py)
            self.expert_loads = gather_loads(
                self.comm, self.ctx.topo, timeout_s=timeout_s, skip=lost
            )
        phases.end("traces")
        self.take_tokens()
        # A slot masked in a die's last iteration: its message left before the die's report.
        self._end_lost()
        self.eplb.finish()
        # The requests and cancels sent to the dies: taken before their reports (a lost die's as
        # it leaves).
        wait_all(self.sends, timeout_s=timeout_s, me="TE-shell", event="requests and cancels")
        if self.detector is not None:
            self.detector.close()
        phases.end("detector closed")

    def _dispatch_arrived(self) -> int:
        """Hand the requests that have arrived to DP groups: one message per die per turn, so
        that a die takes a burst of arrivals in one poll (one request per message let a die
        start an iteration between two of its requests, and the second waited a whole
        iteration for its prefill). With run.clock virtual, at virtual arrivals instead."""
        if self.virtual is not None:
            return self.virtual.turn()
        now, num = time.time() - self.started, 0
        to: dict[int, list] = {}
        while self.queue and self.queue[0].arrival_s <= now:
            group = self.balancer.pick(self.queue[0])
            if group is None:
                break  # every DP group is full; wait for completions
            req = self.queue.popleft()
            self.balancer.on_dispatch(group, req)
            record = self.records[req.req_id]
            record.die_rank, record.dispatched_at = group, time.time()
            record.dispatched_vtime = self.vclock_of.get(group, 0.0)
            to.setdefault(group, []).append(req)
            num += 1
        for group, reqs in to.items():
            for req in reqs:
                with trace.span("request", req_id=req.req_id, die=group):
                    trace.flow_start(req.req_id, "request")  # the arrow to the die that takes it
            self.sends.append(self.comm.isend(reqs, dest=group, tag=TAG_REQUEST))
        if to:  # a send taken lets go of its pickled requests (kept till the stop: ~400 B each)
            self.sends = [r for r in self.sends if not r.Test()]
        return num

    def take_tokens(self) -> int:
        num = 0
        while (message := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_TOKENS)) is not None:
            batch = message.recv()
            for step in batch.steps:
                if not self.records[step.req_id].cancelled:
                    self.records[step.req_id].add_step(step.drafts, step.num_accepted)
            self.batches_from[batch.die_rank] += 1
            self.vclock_of[batch.die_rank] = batch.vclock_s
            if self.feed is not None:
                self.feed.took(batch)  # for /metrics
            for req_id, token, is_finished in batch.tokens:
                record = self.records[req_id]
                if record.cancelled:
                    continue  # sampled before the die took the cancel
                if batch.admitted_s >= 0:  # PD's prefill, virtual clock: its only token
                    self.virtual.admitted.setdefault(req_id, batch.admitted_s)
                record.add_token(token, batch.wall_time, batch.vclock_s)
                self.touched.add(req_id)
                if is_finished:
                    record.finished_at = batch.wall_time
                    record.compact()  # kept until the stop for --check and the run file
                    if self.virtual is not None:  # the balancer sees it at its virtual time
                        self.virtual.finished(req_id, batch.vclock_s)
                    else:
                        self.balancer.on_complete(req_id)
                    self.num_open -= 1
            num += 1
        return num

    def _end_lost(self) -> int:
        """End the requests the dies' memory faults ended; how many losses arrived."""
        losses = self.memory.poll()
        for loss in losses:
            self.end_requests(loss.req_ids, loss.reason)
        return len(losses)

    def take_batches(self, expected: dict[int, int], timeout_s: float) -> None:
        """Take token batches until each die's count reached `expected` (die rank -> batches):
        after a failover, every token the survivors sent before they rebuilt."""
        deadline = time.monotonic() + timeout_s
        while any(self.batches_from[g] < n for g, n in expected.items()):
            if not self.take_tokens():
                time.sleep(0.0005)
            if time.monotonic() > deadline and self.feed is None:
                missing = {g: n - self.batches_from[g] for g, n in expected.items()}
                raise WaitTimeout(
                    f"{type(self).__name__}: failover: token batches still missing after "
                    f"{timeout_s:g} s (die rank -> batches): {missing}"
                )

    def drop_groups(self, lost: tuple[int, ...]) -> list[int]:
        """Go on without the DP groups `lost` (an afd expert die is none: ignored); the
        requests they held unfinished (the orphans), which the caller places again."""
        orphans: list[int] = []
        if self.virtual is not None:  # finished ones are no orphans
            self.virtual.apply_finishes()
        for die in lost:
            if die in self.groups:
                orphans += self.balancer.remove_group(die)
        self.groups = tuple(g for g in self.groups if g not in lost)
        self.lost = self.lost + tuple(lost)
        return orphans

    def readmit(self, requests) -> None:
        """Requests to dispatch before every queued one, in the given order."""
        for req in reversed(list(requests)):
            self.queue.appendleft(req)

    def end_requests(self, req_ids, reason: str) -> None:
        """Requests ended on a die (their KV went with a memory fault): finished, with `reason`
        recorded; not checked against the reference."""
        for req_id in req_ids:
            record = self.records[req_id]
            record.lost, record.finished_at = reason, time.time()
            self.touched.add(req_id)
            self.balancer.on_complete(req_id)
            self.num_open -= 1

    def attach(self, feed) -> None:
        """Serve the endpoint's requests (ranks/shell/endpoint.py EndpointFeed) until it
        closes."""
        self.feed = feed

    def admit(self, req, arrived_at: float) -> None:
        """A request from the endpoint (ranks/shell/endpoint.py), arrived at wall time
        `arrived_at`: queued like the workload's, or ended at once when it cannot be served."""
        req = replace(req, arrival_s=arrived_at - self.started)
        reason = rejection(req, self.ctx.cfg)
        self.records[req.req_id] = RequestRecord(req=req, rejected=reason)
        if reason:  # the endpoint checks first; this one is the last word
            self.records[req.req_id].cancelled = f"rejected: {reason}"
            self.touched.add(req.req_id)
            return
        self.queue.append(req)  # arrivals come in order
        self.num_open += 1

    def cancel(self, req_id: int, reason: str) -> None:
        """End an open request now (its client went away, a stop string, shutdown): out of the
        queue, or its die told to drop it and free its KV blocks (TAG_CANCEL). Its tokens so far
        stay in the record; --check compares them with the reference's first ones."""
        record = self.records[req_id]
        if record.finished_at or record.rejected:
            return  # finished before the cancel came
        queued = next((req for req in self.queue if req.req_id == req_id), None)
        if queued is not None:  # not dispatched (or readmitted after its die was lost)
            self.queue.remove(queued)
        else:
            self.balancer.on_complete(req_id)
            self.sends.append(self.comm.isend(req_id, dest=record.die_rank, tag=TAG_CANCEL))
        record.cancelled, record.finished_at = reason, time.time()
        self.num_open -= 1
        self.touched.add(req_id)

    def open_requests(self) -> list[int]:
        """Requests admitted and not finished, queued or on a die."""
        return [
            r for r, record in self.records.items() if not (record.finished_at or record.rejected)
        ]

    def projected_times(self, req_id: int) -> tuple[float, float]:
        """(TTFT, TPOT) of `req_id` on the dies' 910C virtual clocks, seconds (nan: not yet)."""
        record = self.records[req_id]
        return record.projected_ttft_s(), record.projected_tpot_s()

    def prefill_rank(self, req_id: int) -> int:
        """The die that prefilled `req_id` apart from its decode die (PD only; -1: none)."""
        return -1

    def progress(self) -> Snapshot:
        served = [r for r in self.records.values() if not r.rejected]
        return Snapshot(
            done=sum(1 for r in served if r.finished_at),
            total=len(served),
            tokens=sum(len(r.tokens) for r in served),
            max_tokens=sum(r.req.max_new_tokens for r in served),
            running=sum(self.balancer.num_pending.values()),
            queued=len(self.queue),
            elapsed_s=time.time() - self.started,
            vtime_s=max((self.vclock_of.get(g, 0.0) for g in self.groups), default=0.0)
            if self.virtual is not None
            else -1.0,
        )

    def lost_dies(self) -> tuple[int, ...]:
        """The DP groups lost and scaled away (ranks/recovery/scale_down.py)."""
        return self.lost

    def has_failed_over(self) -> bool:
        """Did the dies rebuild without some die (or all of them, after a stuck one)?"""
        return self.detector is not None and bool(self.detector.detections)

    def _placement(self):
        """The expert placement now: EPLB's when it balances, else the topology's."""
        placement = self.eplb.placement
        return static_placement(self.ctx) if placement is None else placement

    def failure_records(self) -> list:
        """One record per stuck/dead row (and per die silent without one); [] if unwatched."""
        if self.detector is None:
            return []
        recovery = {rank: report.recovery for rank, report in self.reports.items()}
        return self.detector.records(self.records, self.started, recovery)

    def arrival_wall(self, req_id: int) -> float:
        return self.started + self.records[req_id].req.arrival_s
