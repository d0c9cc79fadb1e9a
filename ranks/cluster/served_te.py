"""A TE-shell of a served cluster (`xds-mpi serve` with cluster.num_tes > 1, docs/serve.md "A
cluster"): its requests come from the JE's endpoint on the wall clock, and its news goes back.

`ServedTeFeed` is the TE-shell Frontend's feed (ranks/shell/frontend.py: is_open, ready, turn,
took, failing_over), as EndpointFeed is a lone TE-shell's (ranks/shell/endpoint.py); each turn:

Step 1: take the JE's commands in the order sent: admit its requests into the frontend (which
  dispatches them with the DP load balancer, as a lone TE-shell does the endpoint's), cancel
  the ones whose client went away, and at shutdown close (the loop ends once none is open).
Step 2: send the JE the news: each touched request's new tokens with their times (the JE
  streams them to its client), the token batches' timings, readiness, failover and gauges.

Every wait is bounded: the feed stays open at most run.timeout_s after the dies are up (error
naming the TE, its open requests and the last command).
"""

from __future__ import annotations

import math
import time

from mpi4py import MPI

from ranks.cluster.serve_messages import (
    TAG_CLUSTER_NEWS,
    TAG_CLUSTER_SERVE,
    Commands,
    DieTimes,
    TeGauges,
    TeNews,
    TokenNews,
)
from ranks.core.control import WaitTimeout
from xds_mpi.plan.cluster import JE_RANK


class ServedTeFeed:
    """The feed of a served cluster's TE-shell: the JE's commands in, its news out."""

    def __init__(self, frontend, link) -> None:
        self.frontend, self.link = frontend, link  # link: ranks/cluster/link.py ClusterLink
        self.timeout_s = frontend.ctx.cfg.run.timeout_s
        self.deadline = math.inf  # time.monotonic(): from ready()
        self.is_ready = self.is_failing_over = self.is_shutdown = False
        self.num_commands = 0  # Commands taken from the JE
        self.num_published: dict[int, int] = {}  # req_id -> tokens sent, while it is open
        self.batches: list[DieTimes] = []  # token batches taken since the last news
        self.sent_gauges: TeGauges | None = None
        self.sends: list[MPI.Request] = []

    @property
    def is_open(self) -> bool:
        """Until the JE's shutdown (the loop then ends once no request is open)."""
        return not self.is_shutdown

    def ready(self) -> None:
        """The dies are up and the serving loop turns: the JE's /health may answer 200."""
        self.is_ready = True
        self.deadline = time.monotonic() + self.timeout_s
        self._send_news(force=True)

    def failing_over(self, is_failing_over: bool) -> None:
        """A die of this TE silent (fence, verdict, rebuild): the JE's /health answers 503."""
        self.is_failing_over = is_failing_over
        self._send_news(force=True)

    def took(self, batch) -> None:
        """A TokenBatch the frontend took from a die: its timings for the JE's /metrics."""
        self.batches.append(
            DieTimes(
                die_rank=batch.die_rank,
                iteration_s=batch.iteration_s,
                xccl_s=batch.xccl_s,
                num_drafts=sum(len(step.drafts) for step in batch.steps),
                num_accepted=sum(step.num_accepted for step in batch.steps),
            )
        )

    def turn(self) -> int:
        num = self._take_commands()  # Step 1
        num += self._send_news()  # Step 2
        if self.is_shutdown:  # the frontend waits for them before the dies' reports
            self.frontend.sends.extend(self.sends)
            self.sends = []
        if time.monotonic() > self.deadline:
            raise WaitTimeout(
                f"TE-shell of TE {self.link.te}: serving not done after run.timeout_s"
                f"({self.timeout_s:g}): {self.frontend.num_open} requests open, "
                f"{self.num_commands} commands taken from the JE, shutdown {self.is_shutdown}"
            )
        return num

    def _take_commands(self) -> int:
        frontend, comm, num = self.frontend, self.link.comm, 0
        while (message := comm.improbe(source=JE_RANK, tag=TAG_CLUSTER_SERVE)) is not None:
            commands: Commands = message.recv()
            for admit in commands.admits:
                frontend.admit(admit.req, admit.arrived_at)
            for req_id, reason in commands.cancels:
                frontend.cancel(req_id, reason)
            self.is_shutdown = self.is_shutdown or commands.shutdown
            self.num_commands += 1
            num += 1
        return num

    def _send_news(self, *, force: bool = False) -> int:
        """One TeNews when anything changed since the last (or `force`)."""
        frontend = self.frontend
        touched, frontend.touched = frontend.touched, set()
        requests = tuple(self._news(req_id) for req_id in sorted(touched))
        gauges = self._gauges()
        if not (requests or self.batches or force or gauges != self.sent_gauges):
            return 0
        detector = frontend.detector
        news = TeNews(
            te=self.link.te,
            is_ready=self.is_ready,
            is_failing_over=self.is_failing_over,
            num_detections=len(detector.detections) if detector is not None else 0,
            requests=requests,
            batches=tuple(self.batches),
            gauges=gauges,
        )
        self.sends.append(self.link.comm.isend(news, dest=JE_RANK, tag=TAG_CLUSTER_NEWS))
        self.sends = [r for r in self.sends if not r.Test()]  # a taken send lets go of its copy
        self.batches, self.sent_gauges = [], gauges
        return 1

    def _news(self, req_id: int) -> TokenNews:
        """`req_id`'s tokens since its last news; nothing kept once it ended."""
        record = self.frontend.records[req_id]
        done = self.num_published.pop(req_id, 0)
        ended = record.cancelled or record.lost
        if not (record.finished_at or ended):
            self.num_published[req_id] = len(record.tokens)
        return TokenNews(
            req_id=req_id,
            tokens=tuple(record.tokens[done:]),
            token_times=tuple(record.token_times[done:]),
            token_vtimes=tuple(record.token_vtimes[done:]),
            die_rank=record.die_rank,
            dispatched_vtime=record.dispatched_vtime,
            finished_at=record.finished_at,
            ended=ended,
        )

    def _gauges(self) -> TeGauges:
        frontend = self.frontend
        balancer = frontend.balancer
        return TeGauges(
            num_open=frontend.num_open,
            queued=tuple(req.req_id for req in frontend.queue),
            groups=tuple(balancer.groups),
            kv_reserved=tuple(balancer.reserved[g] for g in balancer.groups),
            kv_capacity=balancer.capacity,
        )
