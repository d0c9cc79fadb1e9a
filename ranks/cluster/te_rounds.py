"""The virtual-clock JE's rounds with its TE-shells (docs/cluster.md "The rule on the virtual
clock", "A lost TE"): take their finishes and reports, route up to the earliest busy TE's start,
grant each TE its requests and the promise; a lost TE found and its unfinished requests routed
again."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from mpi4py import MPI

from ranks.cluster.messages import TAG_CLUSTER_FINISHED, TAG_CLUSTER_TE_LOST, TeLost
from ranks.core.vtime_messages import TAG_VTIME_GRANT, Grant
from ranks.shell.virtual_time import Finishes, GrantRounds
from xds_mpi.config.cluster import TeLoss
from xds_mpi.plan.cluster import te_config
from xds_mpi.scheduling.admission import Completions, decide

if TYPE_CHECKING:
    from ranks.cluster.je import JobExecutor

INF = math.inf


class TeRounds(GrantRounds):
    """The JE's rounds with its TE-shells: route, grant, take their finishes and reports; a lost
    TE (cluster.te_losses) found and its unfinished requests routed again."""

    def __init__(self, je: JobExecutor) -> None:
        cfg, cluster = je.ctx.cfg, je.ctx.plan.cluster
        shells = [cluster.shell(te) for te in range(cluster.num_tes)]
        super().__init__(je.comm, shells, timeout_s=cfg.run.timeout_s, who=je.name)
        self.shell, self.num_jes = cluster.shell, cluster.num_jes
        self.je = je
        self.live = list(shells)  # the TE-shells of the TEs not lost (found so)
        self.completions = Completions()  # finishes not yet applied to the loads
        self.finishes = Finishes(
            je.comm, TAG_CLUSTER_FINISHED, self.completions, who=je.name, accept=self._accept
        )
        self.decided_s = 0.0
        # A TE lost at virtual t finishes nothing after t; the JE finds it a heartbeat timeout
        # and one ping later (the TE-shells' own detection of a die, docs/failures.md).
        self.losses = deque(cfg.cluster.te_losses)  # not found yet, by at_s
        self.lost_at = {loss.te: loss.at_s for loss in cfg.cluster.te_losses}
        self.detect_s = cfg.health.timeout_s + cfg.health.dp_interval_s
        self.found_at: dict[int, float] = {}  # TE -> when the JE found it lost
        self.finished: set[int] = set()  # req_id: finishes taken (a lost TE's before its loss)
        self.again_at: dict[int, float] = {}  # req_id -> routed again from then (a lost TE's)
        # A TE whose own die may be lost for good (a dead or stuck row in its config) tells the
        # JE when it is (`TeLost`): the JE then promises no TE more than a detection past the
        # earliest busy TE's start (its orphans are routed again no earlier), and keeps its
        # rounds until every TE is idle.
        self.may_lose = any(
            row.kind in ("dead", "stuck")
            for t in cluster.tes
            for row in te_config(cfg, t.overrides).faults.events
        )
        self.is_watching = self.may_lose

    @property
    def actors(self) -> list[int]:
        return self.live

    def arrival_of(self, req) -> float:
        """When a request is routed: at its arrival, or, orphaned by a lost TE, once found."""
        return self.again_at.get(req.req_id, req.arrival_s)

    def _accept(
        self, shell: int, req_id: int, vtime_s: float, first_s: float, num_tokens: int = 0
    ) -> bool:
        """A finish counts unless its TE was lost before it (the emulated TE runs on); the
        autoscaler learns its TTFT and TPOT (nan: one token, or the tokens not reported)."""
        if vtime_s > self.lost_at.get(shell - self.num_jes, INF):
            return False
        self.finished.add(req_id)
        if self.je.autoscaler is not None:
            tpot_s = (vtime_s - first_s) / (num_tokens - 1) if num_tokens > 1 else math.nan
            ttft_s = first_s - self.je.records[req_id].req.arrival_s
            self.je.autoscaler.finished(vtime_s, ttft_s, tpot_s)
        return True

    def turn(self) -> int:
        num = self._take_reports() + self.finishes.take() + self._take_te_losses()
        je = self.je
        if je.weights is not None:  # a pool fork source's release, once its readers loaded
            num += je.weights.poll_loads(je.sends)
        if not je.queue and not self.losses and not self.is_watching:
            return num  # the last grant promised inf: nothing more to route
        missing = self.missing()
        if missing:
            self._check_waiting(missing, len(self.reports) + self.finishes.taken.total())
            return num
        reports = [self.reports[s] for s in self.actors]
        self.finishes.take_counted({r.die_rank: r.num_batches for r in reports}, self.timeout_s)
        busy = [r.start_s for r in reports if not r.is_idle]
        now_s = min(busy) if busy else None
        if self.losses:  # found once every TE passed it and every earlier arrival is routed
            found_s = self.losses[0].at_s + self.detect_s
            head_s = self.arrival_of(je.queue[0]) if je.queue else INF
            if (now_s is None or now_s >= found_s) and head_s >= found_s:
                self._lose(self.losses.popleft().te, found_s)
                busy = [self.reports[s].start_s for s in self.actors if not self.reports[s].is_idle]
                now_s = min(busy) if busy else None
                num += 1
            elif now_s is not None:
                now_s = min(now_s, found_s)
        grant = decide(
            je.queue,
            je.loads,
            self.completions,
            now_s=now_s,
            after_s=self.decided_s,
            arrival_of=self.arrival_of,
        )
        if je.weights is not None:  # a scale-out's load order, before the grant routing there
            je.weights.send_orders(je.autoscaler.events, je.sends, je.autoscaler.pool)
        # the promise: the next arrival, or a loss found before it (its orphans go elsewhere)
        promise_s = min([grant.horizon_s, *(loss.at_s + self.detect_s for loss in self.losses)])
        if self.is_watching:  # a loss not known yet is found a detection after a busy start
            starts = [*busy, *(d.vtime_s for d in grant.decisions)]
            if starts:
                promise_s = min(promise_s, min(starts) + self.detect_s)
            elif not je.queue and not self.losses:
                self.is_watching = False  # every TE idle, nothing to route: none to lose
        to: dict[int, list] = {s: [] for s in self.actors}
        for d in grant.decisions:
            to[self.shell(d.group)].append(d)
            je.routed_s[d.req.req_id] = self.decided_s = d.vtime_s
        seq = self._new_round(promise_s)
        for shell, decisions in to.items():
            message = Grant(
                seq=seq,
                requests=tuple(d.req for d in decisions),
                horizon_s=promise_s,
                warp_s=-INF,
                times=tuple(d.vtime_s for d in decisions),
            )
            je.sends.append(self.comm.isend(message, dest=shell, tag=TAG_VTIME_GRANT))
        return num + 1

    def _take_te_losses(self) -> int:
        """A TE-shell's word that its dies cannot go on (`TeLost`): its finishes before it
        taken, then it is lost from its loss's virtual time as a `cluster.te_losses` row would
        have it (found a heartbeat timeout later); it reports no more."""
        num, status = 0, MPI.Status()
        while message := self.comm.improbe(MPI.ANY_SOURCE, TAG_CLUSTER_TE_LOST, status):
            shell = status.Get_source()
            lost: TeLost = message.recv()
            self.finishes.take_counted({shell: lost.num_batches}, self.timeout_s)
            te = shell - self.num_jes
            self.lost_at[te] = lost.at_s
            self.losses.append(TeLoss(te=te, at_s=lost.at_s))
            self.losses = deque(sorted(self.losses, key=lambda loss: loss.at_s))
            self.live.remove(shell)
            self.reports.pop(shell, None)
            self.je.log.warning(
                "%s: TE %d lost at %.3f s virtual (its TE-shell: %s)",
                self.je.name,
                te,
                lost.at_s,
                lost.why,
            )
            num += 1
        return num

    def _lose(self, te: int, found_s: float) -> None:
        """TE `te` found lost at `found_s`: no candidate any more, its requests not finished
        before its loss routed again from then (first in the queue: every later arrival comes
        after), its TE-shell promised nothing more (it serves what it holds to the end, for
        nothing: the emulated TE runs on; its finishes after the loss do not count)."""
        je, shell = self.je, self.shell(te)
        je.loads.lost.add(te)
        if je.autoscaler is not None:  # no source, no standby TE, no drain any more
            je.autoscaler.lose(te, self.lost_at[te])
        orphans = sorted(
            (je.records[r].req for r, t in je.loads.te_of.items() if t == te),
            key=lambda req: (req.arrival_s, req.req_id),
        )
        orphans = [req for req in orphans if req.req_id not in self.finished]
        for req in orphans:
            je.loads.on_complete(req.req_id)  # off the lost TE's load
            self.again_at[req.req_id] = found_s
            je.orphaned[req.req_id] = te
        je.queue.extendleft(reversed(orphans))
        self.found_at[te] = found_s
        if shell in self.live:  # not gone already (its TE-shell told the loss)
            self.live.remove(shell)
        self.reports.pop(shell, None)
        final = Grant(seq=self.seq, requests=(), horizon_s=INF, warp_s=-INF, times=())
        je.sends.append(self.comm.isend(final, dest=shell, tag=TAG_VTIME_GRANT))
        je.log.warning(
            "%s: TE %d lost at %.3f s virtual, found at %.3f s: %d unfinished requests routed "
            "again (%s)",
            je.name,
            te,
            self.lost_at[te],
            found_s,
            len(orphans),
            [req.req_id for req in orphans],
        )
