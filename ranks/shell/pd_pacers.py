"""PD on the virtual clock (run.clock virtual with pd.enabled, docs/virtual_time.md "PD").

Two shells pace two kinds of actors with the grants and clock reports of
ranks/shell/virtual_time.py:

- The JE paces the prefill TEs (`PrefillPacer`; each TE's dies run in lockstep and its leader
  reports, ranks/pd/prefill_vtime.py). It routes each arrival to a prefill TE at its virtual
  arrival from the TEs' loads then (xds_mpi/pd/route.py; a request leaves its TE's load at the
  virtual end of the prefill step that sampled its first token), up to the earliest start of a
  busy TE: every task those TEs will still hand over ends after it.
- The decode TE-shell paces the decode dies (`DecodePacer`, the colocated dies' side unchanged).
  Its queue holds the prefilled tasks, each arriving at the end of its prefill; the JE forwards
  them with a *promise*: no task ending before it is still to come (the earliest start of a busy
  prefill TE, of a request just routed, or of the next arrival). The decode balancer (xDeepServe
  §4.3, with the dies' batch and KV limits) picks a task's DP group at its arrival, from the
  finishes up to then; its KV lands after the transfer over the pair's link
  (xds_mpi/plan/kv_link.py `KvTransferTimes`), and the decode TE-shell grants it to its die only
  once the dies have reached that time: it joins the first decode iteration starting at or after
  it (the die pulls the bytes and waits for them before that iteration, ranks/pd/receive.py). A
  request with no slot at its arrival waits at the decode TE-shell for the finish that frees
  one (backpressure on the virtual clock). The decode dies run no iteration that starts past
  the promise, the next undecided task or the next KV arrival.

Nothing waits in a circle: the prefill side never waits for decode (its KV blocks are freed when
the task is handed over, ranks/pd/send.py), and the decode side waits only for the prefill
side's promise, which grows as the prefill TEs run.

A decode die that may be lost (a stuck or dead row on one, ranks/recovery/decode_loss.py) sends
requests back to prefill at the failover's end, so the decode side bounds its own promise: no
such request arrives before the earliest start of a decode iteration still to come plus the
failover's price (`LossBound`, at least FailoverCost's 8.7 s with the tests' health), and the JE
routes no arrival and grants no prefill TE past it, nor promises past it. The bound grows as
the decode dies run, and an idle decode side's next iteration starts no earlier than the JE's
promise: each side moves the other on. On a loss the decode TE-shell drops the lost dies, prices
the failover as the colocated TE-shell does (the survivors resume at the fault plus
FailoverCost) and grants nothing until the JE has moved the lost dies' requests (`num_losses`
in its Promised): their re-routed tasks are then in its queue, decided from the resumption on.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from dataclasses import replace

from ranks.core.control import WaitTimeout
from ranks.core.messages import JE
from ranks.core.vtime_messages import TAG_VTIME_GRANT, Grant
from ranks.pd.messages import TAG_PD_DONE, TAG_PD_LOSS_BOUND, TAG_PD_TASK, LossBound, Promised
from ranks.recovery.watch import is_watched
from ranks.shell.virtual_time import Finishes, GrantRounds
from xds_mpi.pd.route import pick_prefill_te
from xds_mpi.plan.failures.checks import release_bound_s
from xds_mpi.plan.failures.loss import FailoverCost
from xds_mpi.plan.kv_link import KvTransferTimes
from xds_mpi.scheduling.admission import Completions, decide
from xds_mpi.scheduling.balancer import DecodeBalancer

INF = math.inf


class RouterBalancer:
    """The JE's prefill router (xds_mpi/pd/route.py) as `decide` asks a balancer: pick, dispatch,
    complete (a request's prefill done)."""

    def __init__(self, router) -> None:
        self.router = router

    def pick(self, req) -> int:
        r = self.router
        return pick_prefill_te(len(req.prompt), r.loads, r.long_prompt_tokens, r.lost)

    def on_dispatch(self, te: int, req) -> None:
        self.router.dispatch(req.req_id, len(req.prompt))

    def on_complete(self, req_id: int) -> None:
        self.router.prefilled(req_id)


class PrefillPacer(GrantRounds):
    """On the JE (ranks/shell/je.py): its queue, router and records; `turn` in place of the wall
    clock's dispatch."""

    def __init__(self, je) -> None:
        pd = je.pd_plan
        super().__init__(je.comm, pd.leaders, timeout_s=je.ctx.cfg.xccl.poll_timeout_s, who="JE")
        self.je, self.tes = je, pd.tes
        self.router = RouterBalancer(je.router)
        self.completions = Completions()  # prefills done, not yet applied to the router
        self.decided_s = 0.0
        self.prefilled_from: Counter[int] = Counter()  # prefill die -> tasks taken
        self.promise_s = 0.0  # sent to the decode TE-shell
        self.sent_promise_s = -INF
        self.outgoing: list = []  # Routed tasks for the decode TE-shell, not yet sent
        # Tasks handed over whose KV has not moved yet, beyond which the JE routes no more (a
        # bound on the packed KV the prefill dies hold, ranks/pd/send.py; wall time only): the
        # decode dies' slots four times over, plus one step's prompts per prefill die, which
        # may all end past the horizon.
        cfg = je.ctx.cfg
        num_slots = len(pd.decode) * cfg.scheduler.max_batch_per_die
        self.max_ahead = 4 * num_slots + cfg.xccl.max_tokens_per_die * len(pd.prefill)
        # A decode die that may be lost: nothing routed, granted or promised past the decode
        # side's bound (DecodePacer._bound_losses; at the start its floor is 0).
        may_lose = is_watched(cfg, je.ctx.plan)
        self.loss_bound_s = FailoverCost.of(cfg.health).total_s if may_lose else INF
        self.bounds: list[LossBound] = []  # received, for losses the JE has not handled yet
        self.num_losses = 0  # decode losses handled (their requests moved)
        self.sent_losses = 0

    def turn(self) -> int:
        """Take the TEs' reports and messages; once every TE reported, route and grant."""
        je = self.je
        num = self._take_reports() + je.take_prefilled() + self._take_bounds()
        missing = self.missing()
        if missing:
            self._check_waiting(missing, len(self.reports) + self._num_taken())
            return num + self._forward()
        reports = [self.reports[g] for g in self.actors]
        self._take_counted(reports)
        busy = [r.start_s for r in reports if not r.is_idle]
        promise = min([*busy, self.loss_bound_s])
        if je.queue and self._ahead() > self.max_ahead:
            # The prefill side is far ahead of decode in wall time: no new grant until decode
            # has pulled some of the KV the prefill dies hold. Virtual times do not change: the
            # TEs stay parked at the horizon, and no task can end before it.
            self.promise_s = max(self.promise_s, min(promise, self.horizon_s))
            return num + self._forward()
        if je.queue:
            grant = self._decide(now_s=min(busy) if busy else None)
            # Held at the decode side's bound, nothing new: the TEs stay parked as they are.
            is_held = not grant.decisions and grant.horizon_s == self.horizon_s
            if not is_held or self.loss_bound_s == INF:
                self._send(grant)
                num += 1
            firsts = [d.vtime_s for d in grant.decisions[:1]]
            promise = min([promise, *firsts, grant.horizon_s])
        self.promise_s = max(self.promise_s, promise)
        return num + self._forward()

    def _decide(self, *, now_s: float | None):
        """`decide` over the arrivals before the decode side's bound (a request a decode loss
        sends back may arrive there), the grant's horizon no later than it."""
        je, bound_s = self.je, self.loss_bound_s
        num_before = sum(1 for req in je.queue if req.arrival_s < bound_s)  # arrival order
        before = deque(je.queue[i] for i in range(num_before))
        rest = [je.queue[i] for i in range(num_before, len(je.queue))]
        grant = decide(before, self.router, self.completions, now_s=now_s, after_s=self.decided_s)
        je.queue.clear()
        je.queue.extend([*before, *rest])
        return replace(grant, horizon_s=min(grant.horizon_s, bound_s))

    def _take_bounds(self) -> int:
        """The decode side's bounds; one counts once the JE has handled the losses it
        follows (their requests, moved, are in the JE's queue)."""
        num, shell = 0, self.je.pd_plan.decode_shell
        while (message := self.comm.improbe(source=shell, tag=TAG_PD_LOSS_BOUND)) is not None:
            self.bounds.append(message.recv())
            num += 1
        for bound in [b for b in self.bounds if b.num_losses <= self.num_losses]:
            self.loss_bound_s = max(self.loss_bound_s, bound.bound_s)
            self.bounds.remove(bound)
        return num

    def prefill_again(self, req, arrival_s: float) -> None:
        """A request a lost decode die was decoding, with its tokens so far (scale_down.resumed):
        queued at the JE, arriving when the decode failover ends (virtual `arrival_s`, at or
        past the bound the JE held: nothing was routed at or after it)."""
        assert arrival_s >= self.loss_bound_s or self.loss_bound_s == INF, (arrival_s,)
        queue = [*self.je.queue, replace(req, arrival_s=arrival_s)]
        queue.sort(key=lambda r: (r.arrival_s, r.req_id))
        self.je.queue.clear()
        self.je.queue.extend(queue)

    def take_last_bounds(self) -> None:
        """After the decode TE-shell's book, which it sends after its last bound: every bound
        taken, so that none is left unmatched (MPI_Finalize fails on one)."""
        self._take_bounds()

    def handled_loss(self) -> None:
        """A decode loss's requests moved (re-routed tasks in `outgoing`, the rest queued): the
        decode TE-shell learns it with them, and the bounds that follow the loss count."""
        self.num_losses += 1
        self._take_bounds()

    def _ahead(self) -> int:
        """Tasks handed over whose KV transfer the JE has not heard of."""
        return sum(self.prefilled_from.values()) - len(self.je.pd_book.transfers)

    def prefilled(self, task) -> None:
        """A PD-transfer task taken: its request leaves its TE's load at the task's end, and
        goes to the decode TE-shell with the next promise."""
        self.completions.add(task.req.req_id, task.end_v)
        self.admitted.setdefault(task.req.req_id, task.start_v)
        self.prefilled_from[task.prefill_rank] += 1

    def route(self, routed) -> None:
        self.outgoing.append(routed)

    def finished(self, req_id: int, vtime_s: float) -> None:
        """A request's last token (a prefill's only one, or decode's last): done with prefill
        by then (a no-op for one already prefilled)."""
        self.completions.add(req_id, vtime_s)

    def apply_finishes(self) -> None:
        self.completions.apply_until(INF, self.router)

    def _num_taken(self) -> int:
        return sum(self._taken_from(te) for te in range(len(self.tes)))

    def _take_counted(self, reports) -> None:
        """Every task and token batch the TEs sent before their reports (bounded)."""
        je = self.je
        deadline = time.monotonic() + self.timeout_s
        te_of = {ranks[0]: te for te, ranks in enumerate(self.tes)}  # leader -> its TE
        expected = {te_of[r.die_rank]: r.num_batches for r in reports}
        while missing := {
            te: n - self._taken_from(te) for te, n in expected.items() if self._taken_from(te) < n
        }:
            if not (je.take_prefilled() + je.take_tokens()):
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"JE: prefill TE(s) {sorted(missing)} reported messages not received "
                        f"after {self.timeout_s:g} s (TE -> messages missing): {missing}"
                    )
                time.sleep(0.0002)

    def _taken_from(self, te: int) -> int:
        ranks = self.tes[te]
        return sum(self.prefilled_from[r] + self.je.batches_from[r] for r in ranks)

    def _send(self, grant) -> None:
        je = self.je
        to: dict[int, list] = {te: [] for te in range(len(self.tes))}
        for decision in grant.decisions:
            req = decision.req
            record = je.records[req.req_id]
            record.dispatched_at = record.wall_arrival = time.time()
            record.dispatched_vtime = decision.vtime_s
            to[decision.group].append(decision)
            self.decided_s = decision.vtime_s
        seq = self._new_round(grant.horizon_s)
        for te, ranks in enumerate(self.tes):
            for rank in ranks:
                mine = to[te] if rank == ranks[0] else []  # the leader's pool
                message = Grant(
                    seq=seq,
                    requests=tuple(d.req for d in mine),
                    horizon_s=grant.horizon_s,
                    warp_s=-INF,  # an idle TE starts at its pool's first arrival itself
                    times=tuple(d.vtime_s for d in mine),
                )
                je.sends.append(je.comm.isend(message, dest=rank, tag=TAG_VTIME_GRANT))

    def _forward(self) -> int:
        """The routed tasks and the promise to the decode TE-shell, in one message (so that
        the promise never overtakes a task)."""
        is_news = self.outgoing or self.num_losses != self.sent_losses
        if not is_news and self.promise_s == self.sent_promise_s:
            return 0
        je = self.je
        message = Promised(
            routed=tuple(self.outgoing), promise_s=self.promise_s, num_losses=self.num_losses
        )
        je.sends.append(je.comm.isend(message, dest=je.pd_plan.decode_shell, tag=TAG_PD_TASK))
        self.outgoing, self.sent_promise_s = [], self.promise_s
        self.sent_losses = self.num_losses
        return 1


class TaskBalancer(DecodeBalancer):
    """§4.3's decode balancer over PD-transfer tasks (their requests)."""

    def pick(self, task) -> int | None:
        return super().pick(task.req)

    def on_dispatch(self, group: int, task) -> None:
        super().on_dispatch(group, task.req)


class DecodePacer(GrantRounds):
    """On the decode TE-shell (ranks/shell/decode_shell.py): the tasks the JE promised, the decode
    dies' grants."""

    def __init__(self, shell) -> None:
        ctx = shell.ctx
        cfg, pd, sched = ctx.cfg, ctx.plan.pd, ctx.cfg.scheduler
        may_lose = is_watched(cfg, ctx.plan)  # a decode die may be lost
        # A grant may wait out a failover (detection, fence, rebuild) besides the XCCL waits.
        timeout_s = cfg.xccl.poll_timeout_s + (release_bound_s(cfg.health) if may_lose else 0)
        super().__init__(shell.comm, pd.decode, timeout_s=timeout_s, who="decode TE-shell")
        self.shell = shell
        self.balancer = TaskBalancer(
            pd.decode,
            max_batch=sched.max_batch_per_die,
            kv_capacity_tokens=sched.num_kv_blocks_per_die * sched.kv_block_tokens,
            block_tokens=sched.kv_block_tokens,
            mtp_depth=sched.mtp_depth,
        )
        self.transfer = KvTransferTimes(cfg, ctx.topo, pd.decode)
        self.queue: list = []  # undecided tasks by (prefill end, req_id)
        self.landing: list = []  # heap: (KV arrival s, req_id, group, task), not yet granted
        self.completions = Completions()
        self.finishes = Finishes(  # the decode dies' completions
            shell.comm, TAG_PD_DONE, self.completions, who="decode TE-shell"
        )
        self.promise_s = 0.0
        self.decided_s = 0.0
        self.num_tasks = 0
        # A decode die that may be lost: the failover's price, the bound sent to the JE.
        self.failover_s = FailoverCost.of(cfg.health).total_s if may_lose else INF
        self.loss_floor_s, self.sent_bound_s = 0.0, -INF
        self.num_losses = 0  # decode losses, here and (je_losses) handled by the JE
        self.je_losses = 0
        self.must_grant = False  # after a failover: a grant goes out even with nothing new

    @property
    def actors(self) -> list[int]:
        return list(self.balancer.groups)  # the live decode dies

    def turn(self) -> int:
        """Take tasks, completions and reports; once every die reported, decide what the
        promise allows and grant."""
        num = self._take_reports() + self._take_tasks() + self.finishes.take()
        if self.je_losses < self.num_losses:  # the JE moves the lost dies' requests first
            return num
        missing = self.missing()
        if missing:
            self._check_waiting(missing, len(self.reports) + self.finishes.taken.total())
            return num
        reports = [self.reports[g] for g in self.actors]
        self.finishes.take_counted({r.die_rank: r.num_batches for r in reports}, self.timeout_s)
        busy = [r.start_s for r in reports if not r.is_idle]
        num += self._bound_losses(busy)
        warp_s = -INF
        if busy:
            now_s = min(min(busy), self.promise_s)
        else:
            head = max(self.queue[0].end_v, self.decided_s) if self.queue else INF
            nxt = min(head, self.landing[0][0] if self.landing else INF)
            if nxt > self.promise_s or nxt == INF:
                # nothing before the promise: wait for the JE
                return num + self.parked(floor_s=self.decided_s)
            now_s = warp_s = max(nxt, max(r.start_s for r in reports))
        queue = deque(self.queue)
        grant = decide(
            queue,
            self.balancer,
            self.completions,
            now_s=now_s,
            after_s=self.decided_s,
            arrival_of=lambda task: task.end_v,
        )
        self.queue = list(queue)
        for d in grant.decisions:
            task = d.req
            moves_s = self.transfer.seconds(task.prefill_rank, d.group, len(task.req.prompt))
            lands = d.vtime_s + moves_s
            heapq.heappush(self.landing, (lands, task.req_id, d.group, task))
            self.decided_s = d.vtime_s
        to: dict[int, list] = {g: [] for g in self.actors}
        while self.landing and self.landing[0][0] <= now_s:
            _, _, group, task = heapq.heappop(self.landing)
            to[group].append(task)
        next_landing = self.landing[0][0] if self.landing else INF
        horizon_s = min(grant.horizon_s, self.promise_s, next_landing)
        is_same = not grant.decisions and not any(to.values()) and horizon_s == self.horizon_s
        if is_same and not self.must_grant:
            return num + self.parked(floor_s=now_s, busy_s=min(busy, default=INF))
        seq = self._new_round(horizon_s)
        self.must_grant = False
        for group, tasks in to.items():
            message = Grant(seq=seq, requests=tuple(tasks), horizon_s=horizon_s, warp_s=warp_s)
            self.shell.sends.append(self.comm.isend(message, dest=group, tag=TAG_VTIME_GRANT))
        return num + 1

    def parked(self, *, floor_s: float, busy_s: float = INF) -> int:
        """The dies wait at the promise (or for the JE's next tasks): a PD pair in a cluster
        tells its JE then (ranks/cluster/pd_side.py); alone, nothing to do."""
        return 0

    def bound_s(self, *, floor_s: float, busy_s: float) -> float:
        """While parked: the earliest virtual time a decode die may still finish a request (inf:
        none unfinished). A busy die's next iteration ends after its start; a task decided
        lands first; an undecided one is decided at or after `floor_s` (the decisions' time:
        no slot frees before the dies' common start) and after its prefill ends."""
        waiting = [max(task.end_v, floor_s) for task in self.queue]
        landing = self.landing[0][0] if self.landing else INF
        return min([busy_s, landing, *waiting])

    def finish(self, timeout_s: float) -> None:
        """At the end: the dies' last reports, and the JE's last promise, sent before its stop
        (left unmatched, it would fail MPI_Finalize); a task in it would be a request lost."""
        super().finish(timeout_s)
        num_tasks = self.num_tasks
        self._take_tasks()
        if self.num_tasks != num_tasks:
            raise RuntimeError(
                f"decode TE-shell: {self.num_tasks - num_tasks} task(s) routed by the JE after "
                "its stop"
            )

    def _take_tasks(self) -> int:
        num = 0
        while (message := self.comm.improbe(source=JE, tag=TAG_PD_TASK)) is not None:
            promised: Promised = message.recv()
            for routed in promised.routed:
                self.queue.append(routed.task)
            self.queue.sort(key=lambda task: (task.end_v, task.req_id))
            self.promise_s = max(self.promise_s, promised.promise_s)
            self.je_losses = max(self.je_losses, promised.num_losses)
            self.num_tasks += len(promised.routed)
            num += 1
        return num

    def _bound_losses(self, busy: list[float]) -> int:
        """Every die reported (none is inside an iteration, so no loss is under way): a loss
        still to come strikes at an iteration starting no earlier than a busy die's start, an
        undecided task's decision, a landing or the promise (an idle die starts none before
        its next task). Its requests reach the JE at that plus the failover's price at the
        earliest: sent to the JE when it grew."""
        if self.failover_s == INF:
            return 0
        waiting = [max(task.end_v, self.decided_s) for task in self.queue[:1]]
        landing = self.landing[0][0] if self.landing else INF
        floor_s = min([*busy, *waiting, landing, self.promise_s])
        self.loss_floor_s = max(self.loss_floor_s, floor_s)
        bound_s = self.loss_floor_s + self.failover_s
        if bound_s <= self.sent_bound_s:
            return 0
        message = LossBound(bound_s=bound_s, num_losses=self.num_losses)
        self.shell.sends.append(self.comm.isend(message, dest=JE, tag=TAG_PD_LOSS_BOUND))
        self.sent_bound_s = bound_s
        return 1

    def lose(self, lost: tuple[int, ...], ready: dict) -> tuple[tuple[int, ...], float, float]:
        """The decode dies `lost`, the survivors rebuilt (`ready`: die -> its Ready, with the
        clock where the fault found it): the lost dies leave the balancer, the grants and the
        landings; the survivors resume at the fault plus FailoverCost, and nothing is decided
        before (ranks/recovery/scale_down.py `_priced`, the colocated TE-shell's rule). The
        finishes known are all before the fault, hence before every later decision: applied
        now, so that finished requests are not among the lost dies'. Returns (the requests the
        lost dies held unfinished, the fault's and the resumption's virtual seconds)."""
        self.finishes.take()
        self.completions.apply_until(INF, self.balancer)
        orphans: list[int] = []
        for die in lost:
            orphans += self.balancer.remove_group(die)
            self.reports.pop(die, None)
        self.landing = [entry for entry in self.landing if entry[2] not in lost]
        heapq.heapify(self.landing)
        fault_s = max(r.fault_vclock_s for r in ready.values())
        resumed_s = fault_s + self.failover_s
        self.decided_s = max(self.decided_s, resumed_s)
        self.num_losses += 1
        self.must_grant = True
        return tuple(sorted(orphans)), fault_s, resumed_s
