"""A PD pair as one TE of a cluster (docs/cluster.md "A PD pair in a cluster"): the pair's own
JE (ranks/shell/je.py) is the TE's TE-shell on the link. Its requests come from the cluster's
JE, each with its routing time and the *promise* (no request is still to come before it), and
it reports to the cluster's JE as a colocated TE-shell does (ranks/cluster/te_side.py): the
finishes first, then once per cluster grant the earliest virtual time the pair may still finish
a request.

- `PairPacer` (the pair's JE) is PD's `PrefillPacer` (ranks/shell/pd_pacers.py) with the
  cluster's promise as a cap: it routes the requests queued for it at their routing times (all
  before the promise), grants its prefill TEs no horizon past the promise and promises its
  decode TE-shell no more than it either.
- `PairDecodePacer` (the pair's decode TE-shell) is PD's `DecodePacer` that tells the pair's JE
  whenever its dies wait at that promise: the promise and the tasks it has taken, the decode
  finishes since the last time, and the earliest virtual time a decode die may still finish a
  request (`DecodeState`).
- The pair's JE reports once its prefill TEs are parked at the promise, every routed request
  has gone to a prefill TE and the decode TE-shell's state is for the current promise and every
  task forwarded: then the earliest finish still possible is the earliest of its busy prefill
  TEs' starts and the decode side's bound, and every finish before it is known (the prefill
  TEs' token batches are counted by their reports, the decode finishes by the decode dies').

Nothing waits in a circle: the pair waits only for the cluster's promise, which the cluster's
JE raises once every TE has reached it, as for colocated TEs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpi4py import MPI

from ranks.cluster.messages import TAG_CLUSTER_POOL, TAG_VTIME_GRANT
from ranks.cluster.te_side import JeFeed, JeGrants, JeReports
from ranks.cluster.weights_load import TeWeightsLoad
from ranks.core.tags import TAG_CLUSTER_LOAD, TAG_PD_DECODE_STATE
from ranks.shell.pd_pacers import DecodePacer, PrefillPacer
from xds_mpi.scheduling.admission import Completions, NextGrant, decide

INF = math.inf


@dataclass(frozen=True, kw_only=True)
class DecodeState:
    """Decode TE-shell -> the pair's JE (TAG_PD_DECODE_STATE), when its dies wait at the promise:
    promise_s and num_tasks: the JE's promise and the tasks taken so far; bound_s: the earliest
    virtual time a decode die may still finish a request (inf: none unfinished); finishes:
    (req_id, virtual s) of the decode finishes since the last state."""

    promise_s: float
    num_tasks: int
    bound_s: float
    finishes: tuple[tuple[int, float], ...]


class Recorded(Completions):
    """Completions that also keep the ones not yet passed on."""

    def __init__(self) -> None:
        super().__init__()
        self.new: list[tuple[int, float]] = []

    def add(self, req_id: int, finish_s: float) -> None:
        super().add(req_id, finish_s)
        self.new.append((req_id, finish_s))


class PairDecodePacer(DecodePacer):
    """The decode TE-shell of a PD pair in a cluster."""

    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.completions = self.finishes.completions = Recorded()
        self.sent: tuple[float, int] = (-INF, -1)  # (promise, tasks) of the last state

    def parked(self, *, floor_s: float, busy_s: float = INF) -> int:
        state = (self.promise_s, self.num_tasks)
        if state == self.sent and not self.completions.new:
            return 0
        message = DecodeState(
            promise_s=self.promise_s,
            num_tasks=self.num_tasks,
            bound_s=self.bound_s(floor_s=floor_s, busy_s=busy_s),
            finishes=tuple(self.completions.new),
        )
        self.completions.new, self.sent = [], state
        self.shell.sends.append(self.comm.isend(message, dest=0, tag=TAG_PD_DECODE_STATE))
        return 1


class PairFeed(JeFeed):
    """The pair's JE serves until the cluster's JE promised no more requests, and a standby
    pair's load at its scale-out is reported."""

    @property
    def is_open(self) -> bool:
        is_loading = self.weights is not None and self.weights.is_pending
        pool = self.pacer.pool  # a pool pair: until the JE's release after its drain
        is_routing = self.pacer.je_promise_s != INF and not (pool is not None and pool.is_released)
        return is_routing or is_loading


class PairPacer(PrefillPacer):
    """The JE of a PD pair in a cluster: the requests the cluster's JEs routed here, the prefill
    TEs' grants and the decode TE-shell's promise capped by its promise, the reports to it."""

    def __init__(self, je, link) -> None:
        super().__init__(je)
        self.link = link  # ranks/cluster/link.py ClusterLink
        self.frontend = je
        # a pool pair's: the rounds so far, held by its JE between activations
        self.pool = link.pool  # ranks/cluster/pool_shell.py PoolShell, or None
        self.grants = self.pool.grants if self.pool else JeGrants(link)  # the promise
        self.done: dict[int, float] = {}  # req_id -> its finish (virtual s), every one known
        if self.pool:
            self.to_je = self.pool.to_je.send_through(je)
        else:
            self.to_je = JeReports(link, je, self.grants)  # the finishes and reports to the JEs
        self.num_forwarded = 0  # tasks forwarded to the decode TE-shell
        self.decode = DecodeState(promise_s=-INF, num_tasks=0, bound_s=INF, finishes=())
        self.weights = TeWeightsLoad(je, link)  # a standby pair's load at its scale-out
        self.feed = PairFeed(self, self.weights)

    def turn(self) -> int:
        je = self.je
        num = self._take_je() + self._take_decode() + self._take_reports() + je.take_prefilled()
        missing = self.missing()
        if missing:
            self._check_waiting(missing, len(self.reports) + self._num_taken())
            return num + self._forward()
        reports = [self.reports[g] for g in self.actors]
        self._take_counted(reports)
        busy = [r.start_s for r in reports if not r.is_idle]
        cap = self.je_promise_s
        if je.queue and self._ahead() > self.max_ahead:  # as PrefillPacer: decode far behind
            self.promise_s = max(self.promise_s, min([*busy, self.horizon_s, cap]))
            return num + self._forward()
        decisions, horizon_s = (), cap
        if je.queue:
            grant = decide(
                je.queue,
                self.router,
                self.completions,
                now_s=min(busy) if busy else None,
                after_s=self.decided_s,
                arrival_of=self._routed,
            )
            decisions, horizon_s = grant.decisions, min(grant.horizon_s, cap)
        if decisions or horizon_s != self.horizon_s:
            self._send(NextGrant(decisions=decisions, horizon_s=horizon_s, warp_s=-INF))
            num += 1
        firsts = [d.vtime_s for d in decisions[:1]]
        self.promise_s = max(self.promise_s, min([*busy, *firsts, horizon_s]))
        num += self._forward()
        if not decisions:
            num += self._report(busy)
        return num

    def route(self, routed) -> None:
        super().route(routed)
        self.num_forwarded += 1

    def finished(self, req_id: int, vtime_s: float) -> None:
        super().finished(req_id, vtime_s)
        self._done(req_id, vtime_s)

    def _done(self, req_id: int, vtime_s: float) -> None:
        """A finish for the cluster's JE, with its first token's virtual time: the prefill
        step's, whose token batch the prefill TEs' reports counted before the task moved on."""
        if req_id not in self.done:
            self.done[req_id] = vtime_s
            first_s = self.je.records[req_id].token_vtimes[0]
            self.to_je.finished((req_id, vtime_s, first_s))

    @property
    def je_promise_s(self) -> float:
        """The cluster JEs' promise: nothing is routed here before it."""
        return self.grants.promise_s

    @property
    def je_seq(self) -> int:
        return self.grants.round

    def _routed(self, req) -> float:
        return self.grants.routed_at[req.req_id]

    def _take_je(self) -> int:
        """The cluster JEs' grants: their requests queued (records made), their promise; a load
        order first (it scales out to this pair: passed on to the dies), sent before the grant
        that may route requests here."""
        num, comm, status = 0, self.link.comm, MPI.Status()
        for source in self.link.jes:  # in the order sent
            while comm.iprobe(source=source, tag=MPI.ANY_TAG, status=status):
                if self.pool is not None and self.pool.is_released:
                    return num  # what follows the drain is the pool JE's loop's
                if status.tag == TAG_CLUSTER_POOL:  # a pool pair drained: its dies go back
                    self.pool.release(comm.recv(source=source, tag=TAG_CLUSTER_POOL))
                elif status.tag == TAG_CLUSTER_LOAD:
                    self.weights.take_order(comm.recv(source=source, tag=TAG_CLUSTER_LOAD))
                elif status.tag == TAG_VTIME_GRANT:
                    self.grants.take(source, comm.recv(source=source, tag=TAG_VTIME_GRANT), self.je)
                else:
                    break
                num += 1
        return num

    def _take_decode(self) -> int:
        num, shell = 0, self.je.pd_plan.decode_shell
        while (message := self.comm.improbe(source=shell, tag=TAG_PD_DECODE_STATE)) is not None:
            self.decode = message.recv()
            for req_id, vtime_s in self.decode.finishes:
                self._done(req_id, vtime_s)
            num += 1
        return num

    def _report(self, busy: list[float]) -> int:
        """Once per cluster grant (none after the last, whose promise is inf), when the pair
        waits at the promise and knows every finish before its bound: the finishes first, then
        the report counting them."""
        if self.to_je.reported == self.grants.round or self.je_promise_s == INF:
            return 0
        decode, cap = self.decode, self.je_promise_s
        if (
            self.je.queue
            or self.horizon_s != cap
            or any(start < cap for start in busy)
            or self.outgoing  # tasks not yet forwarded to the decode TE-shell
            or decode.promise_s != self.sent_promise_s
            or decode.num_tasks != self.num_forwarded
        ):
            return 0
        start_s = min([*busy, decode.bound_s])
        is_idle = len(self.done) == len(self.grants.routed_at)
        return self.to_je.report(start_s=cap if is_idle else start_s, is_idle=is_idle)
