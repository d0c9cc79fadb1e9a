"""The TE-shell's side of a cluster (docs/cluster.md): its requests come from the JE instead of
the workload, each with its routing time and a *promise* (no request routed to it before the
promise is still to come), in the JE's grants. `TePacer` is the TE-shell's VirtualPacer
(ranks/shell/virtual_time.py) deciding among its own dies only up to min(its queue, the promise),
as PD's decode TE-shell does (ranks/shell/pd_pacers.py `DecodePacer`); `JeFeed` keeps the
TE-shell's serving loop open until the JE promised nothing more (promise inf).

Once per JE grant the TE-shell reports, as a die reports to it: when its dies are parked at the
promise (their common start, the earliest virtual time the TE may still finish a request) or
when it holds no unfinished request (idle). Before the report it sends the JE the finishes its
dies reported, with their virtual times, and the report counts those messages, so that the JE
knows every finish before the TE's start when it routes.
"""

from __future__ import annotations

import math
import time

from mpi4py import MPI

from ranks.cluster.messages import TAG_CLUSTER_FINISHED, TAG_VTIME_CLOCK, TAG_VTIME_GRANT
from ranks.cluster.weights_load import TeWeightsLoad
from ranks.core.control import WaitTimeout
from ranks.core.tags import TAG_CLUSTER_LOAD
from ranks.core.vtime_messages import ClockReport, Grant
from ranks.shell.virtual_time import VirtualPacer
from xds_mpi.plan.cluster import JE_RANK
from xds_mpi.results.results import RequestRecord
from xds_mpi.scheduling.admission import NextGrant, decide

INF = math.inf


class TePacer(VirtualPacer):
    """On a cluster TE-shell's Frontend: the requests the JE routed here, the dies' grants up to
    the JE's promise, the reports to the JE."""

    def __init__(self, frontend, link) -> None:
        super().__init__(frontend)
        self.link = link  # ranks/cluster/link.py ClusterLink
        self.promise_s = 0.0  # nothing may be decided before the JE's first grant
        self.je_seq = 0  # the JE grant held
        self.routed_at: dict[int, float] = {}  # req_id -> the JE's routing (virtual s)
        self.to_je = JeReports(link, frontend)  # the finishes and reports to the JE
        self.weights = TeWeightsLoad(frontend, link)  # a standby TE's load at its scale-out
        self.feed = JeFeed(self, self.weights)

    def finished(self, req_id: int, vtime_s: float) -> None:
        """A finish for the JE, with its first token's virtual time and its tokens (its TTFT
        and TPOT, for the autoscaler's SLO metric)."""
        super().finished(req_id, vtime_s)
        record = self.frontend.records[req_id]
        self.to_je.finished((req_id, vtime_s, record.token_vtimes[0], len(record.tokens)))

    def turn(self) -> int:
        """Take the JE's grants and the dies' reports; once every die reported, decide up to
        min(the dies' common start, the promise) and grant, or report to the JE."""
        num = self._take_reports() + self._take_je()
        frontend = self.frontend
        missing = self.missing()
        if missing:
            news = len(self.reports) + sum(frontend.batches_from.values())
            self._check_waiting(missing, news)
            return num
        reports = [self.reports[g] for g in frontend.groups]
        self._take_batches({r.die_rank: r.num_batches for r in reports})
        busy = [r.start_s for r in reports if not r.is_idle]
        queue, warp_s = frontend.queue, -INF
        if busy:
            now_s = min(min(busy), self.promise_s)
        elif not queue:
            return num + self._report(is_idle=True, start_s=max(r.start_s for r in reports))
        else:
            head = max(self._routed(queue[0]), self.decided_s)
            if head > self.promise_s:  # not before the promise: the JE's next grant first
                return num + self._report(is_idle=False, start_s=head)
            now_s = warp_s = max(head, max(r.start_s for r in reports))
        grant = decide(
            queue,
            frontend.balancer,
            self.completions,
            now_s=now_s,
            after_s=self.decided_s,
            arrival_of=self._routed,
        )
        horizon_s = min(grant.horizon_s, self.promise_s)
        if grant.decisions or horizon_s != self.horizon_s or warp_s != -INF:
            self._send(NextGrant(decisions=grant.decisions, horizon_s=horizon_s, warp_s=warp_s))
            return num + 1
        # The dies are parked at the promise: nothing finishes before their common start.
        return num + self._report(is_idle=False, start_s=min(busy))

    def _take_batches(self, expected: dict[int, int]) -> None:
        """Every token batch the dies counted in their reports (bounded: Frontend.take_batches
        waits without a bound while a feed is attached, as the endpoint's must)."""
        frontend, deadline = self.frontend, time.monotonic() + self.timeout_s
        while any(frontend.batches_from[g] < n for g, n in expected.items()):
            if not frontend.take_tokens():
                if time.monotonic() > deadline:
                    missing = {g: n - frontend.batches_from[g] for g, n in expected.items()}
                    raise WaitTimeout(
                        f"TE-shell of TE {self.link.te}: token batches reported by the dies not "
                        f"received after {self.timeout_s:g} s (die rank -> batches): {missing}"
                    )
                time.sleep(0.0005)

    def _routed(self, req) -> float:
        return self.routed_at[req.req_id]

    def _take_je(self) -> int:
        """The JE's messages in the order it sent them: a load order (it scales out to this TE:
        passed on to the dies) before the grant that may route requests here; the grants: their
        requests queued (records made), their promise."""
        num, frontend, comm, status = 0, self.frontend, self.link.comm, MPI.Status()
        while comm.iprobe(source=JE_RANK, tag=MPI.ANY_TAG, status=status):
            if status.tag == TAG_CLUSTER_LOAD:
                self.weights.take_order(comm.recv(source=JE_RANK, tag=TAG_CLUSTER_LOAD))
                num += 1
                continue
            if status.tag != TAG_VTIME_GRANT:
                break
            grant: Grant = comm.recv(source=JE_RANK, tag=TAG_VTIME_GRANT)
            queue_routed(frontend, grant, self.routed_at)
            self.je_seq, self.promise_s = grant.seq, grant.horizon_s
            num += 1
        return num

    def _report(self, *, is_idle: bool, start_s: float) -> int:
        """Once per JE grant (none after the last, whose promise is inf)."""
        if self.to_je.reported_seq == self.je_seq or self.promise_s == INF:
            return 0
        return self.to_je.report(self.je_seq, start_s=start_s, is_idle=is_idle)


class JeReports:
    """A TE's side of its reports to the cluster's JE (a colocated TE-shell's, a PD pair's JE's):
    its finishes, (req_id, virtual s, first token's virtual s), and once per JE grant the report
    counting the finish messages sent before it, so that the JE takes them all first. `owner`
    holds the pending sends (its `sends` list)."""

    def __init__(self, link, owner) -> None:
        self.link, self.owner = link, owner
        self.rows: list[tuple[int, float, float]] = []  # finishes not yet sent
        self.num_sent = 0  # finish messages sent
        self.reported_seq = 0  # the JE grant last reported for

    def finished(self, row: tuple[int, float, float]) -> None:
        self.rows.append(row)

    def report(self, seq: int, *, start_s: float, is_idle: bool) -> int:
        """The finishes first, then the report for JE grant `seq`."""
        comm, sends = self.link.comm, self.owner.sends
        if self.rows:
            sends.append(comm.isend(tuple(self.rows), dest=JE_RANK, tag=TAG_CLUSTER_FINISHED))
            self.rows, self.num_sent = [], self.num_sent + 1
        report = ClockReport(
            die_rank=self.link.te + 1,
            seq=seq,
            start_s=start_s,
            is_idle=is_idle,
            num_batches=self.num_sent,
        )
        sends.append(comm.isend(report, dest=JE_RANK, tag=TAG_VTIME_CLOCK))
        self.reported_seq = seq
        return 1


def queue_routed(frontend, grant: Grant, routed_at: dict[int, float]) -> None:
    """A JE grant's requests queued on `frontend` (a TE-shell's Frontend, or a PD pair's JE),
    their records made, their routing times kept."""
    for req, routed_s in zip(grant.requests, grant.times, strict=True):
        frontend.records[req.req_id] = RequestRecord(req=req)
        frontend.queue.append(req)
        frontend.num_open += 1
        routed_at[req.req_id] = routed_s


class JeFeed:
    """The TE-shell's serving loop stays open (Frontend.serve) until the JE promised no more
    requests, and a standby TE's load at its scale-out (`weights`: a colocated TE-shell's) is
    reported; bounded by run.timeout_s like the loop itself."""

    def __init__(self, pacer: TePacer, weights: TeWeightsLoad | None = None) -> None:
        self.pacer, self.weights = pacer, weights
        cfg = pacer.frontend.ctx.cfg
        self.timeout_s = cfg.run.timeout_s
        self.deadline = math.inf

    @property
    def is_open(self) -> bool:
        """Until the JE's last grant, and the dies' load at a scale-out reported."""
        is_loading = self.weights is not None and self.weights.is_pending
        return self.pacer.promise_s != INF or is_loading

    def ready(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def turn(self) -> int:
        num = self.weights.turn() if self.weights is not None else 0  # the dies' loads, to the JE
        if time.monotonic() > self.deadline:
            pacer = self.pacer
            raise WaitTimeout(
                f"TE-shell of TE {pacer.link.te}: serving not done after run.timeout_s"
                f"({self.timeout_s:g}): {pacer.frontend.num_open} requests unfinished, promise "
                f"{pacer.promise_s:.6f} s virtual (JE grant {pacer.je_seq})"
            )
        return num

    def took(self, batch) -> None:
        pass

    def failing_over(self, is_failing_over: bool) -> None:
        pass


def send_result(ctx, serving, status: str) -> None:
    """A cluster TE-shell's end (in place of its own run file): its records, admissions, die
    timings and summary to the JE, which checks and writes them with every other TE's."""
    # Lazy import: the link is set on a cluster's TE-shells only (launch/job/rank.py).
    from ranks.cluster.link import cluster_link
    from ranks.cluster.messages import TAG_CLUSTER_RESULT, TeResult
    from ranks.core.control import send_to_each

    if serving is None:  # failed before serving ended: the exception aborts the job
        return
    link = cluster_link()
    result = TeResult(
        te=link.te,
        status=status,
        records=serving.records,
        admitted=serving.admitted,
        die_timings=serving.die_timings,
        summary=serving.summary,
        started=serving.started,
    )
    send_to_each(
        link.comm,
        {JE_RANK: result},
        tag=TAG_CLUSTER_RESULT,
        timeout_s=ctx.cfg.xccl.poll_timeout_s,
        me=f"TE-shell of TE {link.te}",
        event="TE result to the JE",
    )
