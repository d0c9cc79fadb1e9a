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

With several JEs (`cluster.num_jes`, `JeGrants`) the TE's promise is the lowest of theirs; it
reports once per round, when every JE still routing has sent that round's grant, to each of
them, and sends each JE the finishes of the requests that JE routed.
"""

from __future__ import annotations

import math
import time

from mpi4py import MPI

from ranks.cluster.messages import (
    TAG_CLUSTER_FINISHED,
    TAG_CLUSTER_POOL,
    TAG_CLUSTER_TE_LOST,
    TAG_VTIME_CLOCK,
    TAG_VTIME_GRANT,
    TeLost,
)
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
        # a pool TE's: the rounds so far, held by its TE-shell between activations
        self.pool = link.pool  # ranks/cluster/pool_shell.py PoolShell, or None
        self.grants = self.pool.grants if self.pool else JeGrants(link)  # the promise
        self.is_lost = False  # its dies could not go on: the JEs were told (`lost`)
        if self.pool:
            self.to_je = self.pool.to_je.send_through(frontend)
        else:
            self.to_je = JeReports(link, frontend, self.grants)  # the finishes and reports
        self.weights = TeWeightsLoad(frontend, link)  # a standby TE's load at its scale-out
        self.feed = JeFeed(self, self.weights)

    @property
    def promise_s(self) -> float:
        """No request routed before it is still to come (0: before the JEs' first grants)."""
        return self.grants.promise_s

    @property
    def je_seq(self) -> int:
        return self.grants.round

    def finished(self, req_id: int, vtime_s: float) -> None:
        """A finish for the JE, with its first token's virtual time and its tokens (its TTFT
        and TPOT, for the autoscaler's SLO metric)."""
        super().finished(req_id, vtime_s)
        record = self.frontend.records[req_id]
        self.to_je.finished((req_id, vtime_s, record.token_vtimes[0], len(record.tokens)))

    def lost(self, at_s: float, why: str) -> None:
        """The TE's dies cannot go on (from virtual `at_s`): each JE still routing gets the
        finishes not yet sent, then the loss; the TE serves nothing more."""
        self.is_lost = True
        self.to_je.lost(at_s, why)

    def turn(self) -> int:
        """Take the JE's grants and the dies' reports; once every die reported, decide up to
        min(the dies' common start, the promise) and grant, or report to the JE."""
        if self.is_lost:
            return 0
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

    def _take_je(self) -> int:
        """The JEs' messages, each JE's in the order it sent them: a load order (it scales out
        to this TE: passed on to the dies) before the grant that may route requests here; the
        grants: their requests queued (records made), their promise."""
        num, frontend, comm, status = 0, self.frontend, self.link.comm, MPI.Status()
        for je in self.link.jes:
            while comm.iprobe(source=je, tag=MPI.ANY_TAG, status=status):
                if self.pool is not None and self.pool.is_released:
                    return num  # what follows the drain is the pool TE-shell's (its next turn)
                if status.tag == TAG_CLUSTER_POOL:  # a pool TE drained: its dies go back
                    self.pool.release(comm.recv(source=je, tag=TAG_CLUSTER_POOL))
                    num += 1
                    continue
                if status.tag == TAG_CLUSTER_LOAD:
                    self.weights.take_order(comm.recv(source=je, tag=TAG_CLUSTER_LOAD))
                    num += 1
                    continue
                if status.tag != TAG_VTIME_GRANT:
                    break
                self.grants.take(je, comm.recv(source=je, tag=TAG_VTIME_GRANT), frontend)
                num += 1
        return num

    def _report(self, *, is_idle: bool, start_s: float) -> int:
        """Once per round of the JEs' grants (none after the last, whose promise is inf)."""
        return self.to_je.report(start_s=start_s, is_idle=is_idle)

    def _routed(self, req) -> float:
        return self.grants.routed_at[req.req_id]


class JeGrants:
    """The grants a TE holds from the cluster's JEs (one, or `cluster.num_jes`): each JE's last
    grant number and promise, the requests each routed here with their routing times. The TE's
    promise is the lowest; its round is the grant every JE still routing (promise below inf)
    has sent (they grant in step: a JE's next grant waits for every TE's report)."""

    def __init__(self, link) -> None:
        self.seq = dict.fromkeys(link.jes, 0)  # JE -> its grant held (0: none yet)
        self.promises = dict.fromkeys(link.jes, 0.0)  # nothing before the first grants
        self.routed_at: dict[int, float] = {}  # req_id -> its routing (virtual s)
        self.owner: dict[int, int] = {}  # req_id -> the JE that routed it

    @property
    def promise_s(self) -> float:
        return min(self.promises.values())

    @property
    def routing(self) -> list[int]:
        """The JEs still routing: their promise is below inf."""
        return [je for je, promise in self.promises.items() if promise != INF]

    @property
    def round(self) -> int:
        """The grant every JE still routing holds (0: none, or none routing)."""
        return min((self.seq[je] for je in self.routing), default=0)

    def take(self, je: int, grant: Grant, frontend) -> None:
        """JE `je`'s grant: its requests queued on `frontend` (records made), its promise."""
        if grant.requests:  # (a pool TE-shell between activations has no frontend)
            queue_routed(frontend, grant, self.routed_at)
        self.owner.update((req.req_id, je) for req in grant.requests)
        self.seq[je], self.promises[je] = grant.seq, grant.horizon_s


class JeReports:
    """A TE's side of its reports to the cluster's JEs (a colocated TE-shell's, a PD pair's
    JE's): its finishes, (req_id, virtual s, first token's virtual s), each to the JE that routed
    it, and once per round of the JEs' grants the report to each JE still routing, counting the
    finish messages sent to it before, so that the JE takes them all first. `owner` holds the
    pending sends (its `sends` list)."""

    def __init__(self, link, owner, grants: JeGrants) -> None:
        self.link, self.owner, self.grants = link, owner, grants
        self.rows: dict[int, list] = {je: [] for je in link.jes}  # finishes not yet sent
        self.num_sent = dict.fromkeys(link.jes, 0)  # finish messages sent to each JE
        self.reported = 0  # the round last reported for

    def send_through(self, owner) -> JeReports:
        """The pending sends go to `owner.sends` from now on (a pool TE's: its TePacer's frontend
        while its TE is formed, its TE-shell's between)."""
        self.owner = owner
        return self

    def finished(self, row: tuple[int, float, float]) -> None:
        self.rows[self.grants.owner[row[0]]].append(row)

    def lost(self, at_s: float, why: str) -> None:
        """To each JE still routing: its finishes not yet sent, then the loss (`TeLost`)."""
        for je in self.grants.routing:
            self._send_rows(je)
            message = TeLost(at_s=at_s, why=why, num_batches=self.num_sent[je])
            self.owner.sends.append(self.link.comm.isend(message, dest=je, tag=TAG_CLUSTER_TE_LOST))

    def report(self, *, start_s: float, is_idle: bool) -> int:
        """For the current round (once; none once no JE routes): to each JE still routing its
        finishes first, then the report for its grant."""
        grants = self.grants
        if not grants.routing or grants.round == self.reported:
            return 0
        for je in grants.routing:
            self._send_rows(je)
            report = ClockReport(
                die_rank=self.link.rank,
                seq=grants.seq[je],
                start_s=start_s,
                is_idle=is_idle,
                num_batches=self.num_sent[je],
            )
            self.owner.sends.append(self.link.comm.isend(report, dest=je, tag=TAG_VTIME_CLOCK))
        self.reported = grants.round
        return 1

    def _send_rows(self, je: int) -> None:
        """JE `je`'s finishes not yet sent, in one message (counted)."""
        if self.rows[je]:
            rows, self.rows[je] = tuple(self.rows[je]), []
            self.owner.sends.append(self.link.comm.isend(rows, dest=je, tag=TAG_CLUSTER_FINISHED))
            self.num_sent[je] += 1


def queue_routed(frontend, grant: Grant, routed_at: dict[int, float]) -> None:
    """A JE grant's requests queued on `frontend` (a TE-shell's Frontend, or a PD pair's JE) in
    routing order (several JEs' grants interleave), their records made, their routing times
    kept."""
    queue = frontend.queue

    def key(req) -> tuple[float, int]:
        return routed_at[req.req_id], req.req_id

    for req, routed_s in zip(grant.requests, grant.times, strict=True):
        frontend.records[req.req_id] = RequestRecord(req=req)
        frontend.num_open += 1
        routed_at[req.req_id] = routed_s
        at = len(queue)  # after every request routed before it: one JE's come in order
        while at > 0 and queue[at - 1].req_id in routed_at and key(queue[at - 1]) > key(req):
            at -= 1
        queue.insert(at, req)


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
        pool = self.pacer.pool
        is_routing = self.pacer.promise_s != INF and not (pool is not None and pool.is_released)
        return (is_routing or is_loading) and not self.pacer.is_lost

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

    link = cluster_link()
    if link.pool is not None:  # a pool TE's activation: its TE-shell sends one result at the end
        link.pool.keep(serving, status)
        return
    if serving is None:  # failed before serving ended: the exception aborts the job
        return
    result = TeResult(
        te=link.te,
        status=status,
        records=serving.records,
        admitted=serving.admitted,
        die_timings=serving.die_timings,
        summary=serving.summary,
        started=serving.started,
        own=own_run_file(serving),
    )
    send_to_each(
        link.comm,
        {JE_RANK: result},
        tag=TAG_CLUSTER_RESULT,
        timeout_s=ctx.cfg.xccl.poll_timeout_s,
        me=f"TE-shell of TE {link.te}",
        event="TE result to the JE",
    )
    # A lost TE's JEs may have granted before they knew (taken once JE 0 took the result: the
    # JEs route no more by then)
    for je in link.jes:
        while (message := link.comm.improbe(source=je, tag=TAG_VTIME_GRANT)) is not None:
            message.recv()


def own_run_file(serving) -> bytes:
    """The TE's run file as it would write it alone, in memory (HDF5 bytes) for the JE."""
    import io

    import h5py

    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        serving.write(f)
    return buffer.getvalue()
