"""The TE-shell's side of virtual-time serving (run.clock virtual, docs/virtual_time.md).

The TE-shell hands a die work only at virtual times the dies have not passed. Each grant it sends
every die carries the requests decided for that die and a horizon, the next virtual time at which it
may hand work again: the next undecided arrival (inf when none is left). The dies run the iterations
that start before the horizon, then park there (ranks/colocated/virtual_time.py). Once every die has
reported for the current grant (parked at the horizon, or with no work of its own), the TE-shell
takes every token batch they sent (the finishes they carry), decides the queued requests up to the
dies' common virtual start, each at its own virtual time from the state then
(xds_mpi/scheduling/admission.py `decide`), and sends the next grant. When every die is idle the
next grant warps their clocks to the next arrival: idle time costs no wall time.

Every wait is bounded: a grant waits for the dies' reports at most `timeout_s` without news
(a report or a token batch), then raises naming the dies, the grant and the horizon.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from mpi4py import MPI

from ranks.core.control import WaitTimeout
from ranks.core.vtime_messages import TAG_VTIME_CLOCK, TAG_VTIME_GRANT, ClockReport, Grant
from xds_mpi.plan.failures.checks import release_bound_s
from xds_mpi.report import trace
from xds_mpi.scheduling.admission import Completions, NextGrant, decide


class GrantRounds:
    """The rounds of grants and clock reports between a shell rank and the actors it paces (the
    TE-shell's dies; PD: the JE's prefill TEs, the decode TE-shell's dies,
    ranks/shell/pd_pacers.py): the grant the actors hold, their reports for it, the bounded
    waits. `who` names the shell in errors."""

    def __init__(self, comm, actors, *, timeout_s: float, who: str) -> None:
        self.comm, self._actors, self.timeout_s, self.who = comm, list(actors), timeout_s, who
        self.seq = 0  # the grant the actors hold (0: none yet)
        self.horizon_s = 0.0
        # actor rank -> its report for grant `seq`. At the start every actor is idle at virtual
        # 0 with nothing sent: known without a report, so the first grant goes out at once.
        self.reports: dict[int, ClockReport] = {
            g: ClockReport(die_rank=g, seq=0, start_s=0.0, is_idle=True, num_batches=0)
            for g in self._actors
        }
        self.admitted: dict[int, float] = {}  # req_id -> virtual admission (the reports)
        self.news_at, self.news = time.monotonic(), -1

    @property
    def actors(self) -> list[int]:
        """The ranks that report (live ones: a failover drops some)."""
        return self._actors

    def missing(self) -> list[int]:
        """The actors that have not reported for the current grant."""
        return [g for g in self.actors if g not in self.reports]

    def finish(self, timeout_s: float) -> None:
        """At the end: every live actor's report for the last grant (the admissions it
        carries), bounded."""
        deadline = time.monotonic() + timeout_s
        while missing := self.missing():
            if not self._take_reports():
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"{self.who}: no clock report from die rank(s) {missing} for grant "
                        f"{self.seq} after {timeout_s:g} s (the end of the run)"
                    )
                time.sleep(0.0005)
        self._take_reports()  # the first reports when no grant went out (all taken by now)

    def _take_reports(self) -> int:
        num = 0
        while (
            message := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_VTIME_CLOCK)
        ) is not None:
            report: ClockReport = message.recv()
            self.admitted.update(report.admitted)
            if report.seq == self.seq:
                self.reports[report.die_rank] = report
            num += 1
        return num

    def _new_round(self, horizon_s: float) -> int:
        """The next grant's number; its reports start afresh."""
        self.seq += 1
        self.horizon_s = horizon_s
        self.reports = {}
        self.news_at = time.monotonic()
        return self.seq

    def _check_waiting(self, missing: list[int], news: int) -> None:
        """Bounded: news (a report, a message the actors sent) restarts the wait."""
        now = time.monotonic()
        if news != self.news:
            self.news, self.news_at = news, now
        elif now - self.news_at > self.timeout_s:
            raise WaitTimeout(
                f"{self.who}: no clock report from die rank(s) {missing} for grant {self.seq} "
                f"(horizon {self.horizon_s:.6f} s virtual) and no token from any die after "
                f"{self.timeout_s:g} s"
            )


class Finishes:
    """Finish messages, [(req_id, virtual s), ...] on `tag`, taken into `completions` and counted
    per sender, so that a shell takes every one an actor reported sending before it decides
    (PD's decode dies to the decode TE-shell, a cluster's TE-shells to the JE). `accept(sender,
    req_id, virtual s)`, when given, drops the finishes it refuses (a lost TE's, after its loss)."""

    def __init__(self, comm, tag: int, completions: Completions, *, who: str, accept=None) -> None:
        self.comm, self.tag, self.completions, self.who = comm, tag, completions, who
        self.accept = accept
        self.taken: Counter[int] = Counter()  # sender rank -> messages taken

    def take(self) -> int:
        num, status = 0, MPI.Status()
        while (message := self.comm.improbe(MPI.ANY_SOURCE, self.tag, status)) is not None:
            sender = status.Get_source()
            for req_id, vtime_s, *more in message.recv():  # a cluster's: the first token too
                if self.accept is None or self.accept(sender, req_id, vtime_s, *more):
                    self.completions.add(req_id, vtime_s)
            self.taken[sender] += 1
            num += 1
        return num

    def take_counted(self, expected: dict[int, int], timeout_s: float) -> None:
        """Until `expected` (sender rank -> messages sent) are all taken (bounded)."""
        deadline = time.monotonic() + timeout_s
        while missing := {g: n - self.taken[g] for g, n in expected.items() if self.taken[g] < n}:
            if not self.take():
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"{self.who}: finishes reported by rank(s) {sorted(missing)} not "
                        f"received after {timeout_s:g} s (rank -> messages missing): {missing}"
                    )
                time.sleep(0.0002)


class VirtualPacer(GrantRounds):
    """On the TE-shell's Frontend (ranks/shell/frontend.py): its queue, balancer, records and
    DP groups; `turn` in place of the wall clock's dispatch."""

    def __init__(self, frontend) -> None:
        cfg = frontend.ctx.cfg
        # A grant may wait out a failover (detection, fence, rebuild) besides the XCCL waits.
        timeout_s = cfg.xccl.poll_timeout_s + release_bound_s(cfg.health)
        super().__init__(frontend.comm, frontend.groups, timeout_s=timeout_s, who="TE-shell")
        self.frontend = frontend
        self.completions = Completions()  # finishes not yet applied to the balancer
        self.decided_s = 0.0  # the last decision's virtual time
        self.must_grant = False  # after a failover: a grant goes out even with nothing queued

    @property
    def actors(self) -> list[int]:
        return self.frontend.groups  # the live DP groups

    def turn(self) -> int:
        """Take the dies' clock reports; once every die reported, decide and grant. The work
        done (reports taken, grants sent)."""
        num = self._take_reports()
        frontend = self.frontend
        if not frontend.queue and not self.must_grant:
            return num
        missing = self.missing()
        if missing:
            news = len(self.reports) + sum(self.frontend.batches_from.values())
            self._check_waiting(missing, news)
            return num
        reports = [self.reports[g] for g in frontend.groups]
        timeout_s = frontend.ctx.cfg.xccl.poll_timeout_s
        frontend.take_batches({r.die_rank: r.num_batches for r in reports}, timeout_s)
        busy = [r.start_s for r in reports if not r.is_idle]
        grant = decide(
            frontend.queue,
            frontend.balancer,
            self.completions,
            now_s=min(busy) if busy else None,
            after_s=self.decided_s,
            idle_s=max(r.start_s for r in reports),
        )
        self._send(grant)
        return num + 1

    def finished(self, req_id: int, vtime_s: float) -> None:
        """A request's last token, sampled at virtual `vtime_s` on its die."""
        self.completions.add(req_id, vtime_s)

    def failed_over(self, resumed_s: float) -> None:
        """A failover priced on the virtual clock (ranks/recovery/scale_down.py) ends at virtual
        `resumed_s`, the survivors' next common start: no decision before it (the lost dies'
        requests, readmitted, and every queued one are decided from then on), and the next
        grant goes out once the survivors, parked there, have reported, even with nothing
        queued (they wait for it)."""
        self.decided_s = max(self.decided_s, resumed_s)
        self.must_grant = True

    def apply_finishes(self) -> None:
        """Every known finish applied now (a failover: the lost dies' unfinished requests are
        the balancer's, so finished ones must not count among them)."""
        self.completions.apply_until(math.inf, self.frontend.balancer)

    def _send(self, grant: NextGrant) -> None:
        frontend = self.frontend
        to: dict[int, list] = {g: [] for g in frontend.groups}
        for decision in grant.decisions:
            req = decision.req
            record = frontend.records[req.req_id]
            record.die_rank, record.dispatched_at = decision.group, time.time()
            # its arrival on the wall clock: the first decision (a failover decides it again)
            record.wall_arrival = record.wall_arrival or record.dispatched_at
            record.dispatched_vtime = decision.vtime_s
            to[decision.group].append(req)
            with trace.span("request", req_id=req.req_id, die=decision.group):
                trace.flow_start(req.req_id, "request")  # the arrow to the die that takes it
            self.decided_s = decision.vtime_s
        self._new_round(grant.horizon_s)
        self.must_grant = False
        for group, reqs in to.items():
            message = Grant(
                seq=self.seq, requests=tuple(reqs), horizon_s=grant.horizon_s, warp_s=grant.warp_s
            )
            frontend.sends.append(frontend.comm.isend(message, dest=group, tag=TAG_VTIME_GRANT))
