"""The Job Executor of a PD deployment (xDeepServe §5.1 steps 1 and 4), on the host rank.

Step 1: each arrived request goes to a prefill TE chosen by length and load
(engine/pd_route.py), into that TE's shared pending pool at its leader (its prefill DP-0, which
plays the TE-shell); its placement onto one of the TE's DP groups is that leader's single-level
scheduler (engine/pd_prefill.py), which sees every group's status.
Step 4: when a prefill die registers a PD-transfer task, the decode balancer (§4.3, the decode
TE-shell's) picks a decode DP group by load, and the task goes there. It does not wait for that
group's KV space: the decode group defers its receive until it has room (backpressure, step 6).
Tokens come straight from the decode groups (the output shortcut), as in ranks/shell/frontend.py.
"""

from __future__ import annotations

import time

from ranks.core.control import recv_from_each, send_to_each
from ranks.core.messages import TAG_REPORT, TAG_REQUEST, TAG_STOP
from ranks.core.tags import TAG_EMS_REPORT, TAG_PD_CANCEL, TAG_PD_FAULT_BEGAN, TAG_PD_VERDICT
from ranks.pd.messages import TAG_PD_PREFILLED, TAG_PD_READY, TAG_PD_TASK, TAG_PD_TRANSFER
from ranks.recovery.je_decode_loss import DecodeLossWatch
from ranks.recovery.je_prefill_loss import PrefillWatch
from ranks.shell.frontend import Frontend
from xds_mpi.pd.failover import PdFailover, Routed, loss_record, pick_decode
from xds_mpi.pd.results import PdBook
from xds_mpi.pd.route import PrefillRouter
from xds_mpi.scheduling.balancer import DecodeBalancer


class LoadBalancer(DecodeBalancer):
    """§4.3's decode balancer without the capacity cut (the decode group applies it): lowest
    reserved KV, then fewest requests. Requests that ended at prefill never reached it."""

    def on_complete(self, req_id: int) -> int:
        return super().on_complete(req_id) if req_id in self._where else -1


class JobExecutor(Frontend):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        pd, sched = ctx.plan.pd, ctx.cfg.scheduler
        self.pd_plan, self.pd_book, self.failover = pd, PdBook(), PdFailover()
        self.watch = PrefillWatch(self)  # heartbeats to the prefill TEs' leaders (§6.1)
        self.decode_loss = DecodeLossWatch(
            self
        )  # decode dies lost (ranks/recovery/je_decode_loss.py)
        self.router = PrefillRouter(len(pd.tes), ctx.cfg.pd.long_prompt_tokens)
        unbounded = 1 << 40
        self.balancer = LoadBalancer(
            self.groups,
            max_batch=unbounded,
            kv_capacity_tokens=unbounded,
            block_tokens=sched.kv_block_tokens,
            mtp_depth=sched.mtp_depth,
        )
        # serve: req_id -> why, for requests cancelled at prefill or with their KV on the way
        self.cancel_at_decode: dict[int, str] = {}
        if ctx.plan.cluster is not None:  # a PD pair in a cluster (ranks/cluster/pd_side.py)
            from ranks.cluster.link import cluster_link
            from ranks.cluster.pd_side import PairPacer

            self.virtual = PairPacer(self, cluster_link())
            self.feed = self.virtual.feed
        elif ctx.plan.clock.is_virtual:  # the prefill TEs paced (ranks/shell/pd_pacers.py)
            from ranks.shell.pd_pacers import PrefillPacer

            self.virtual = PrefillPacer(self)

    def _dispatch_arrived(self) -> int:
        """Step 1 for arrived requests, step 4 for prefilled ones, and the transfers' numbers."""
        if self.virtual is not None:  # at virtual arrivals, the prefill TEs paced
            return self.virtual.turn() + self._take_transfers() + self.decode_loss.poll()
        now, num = time.time() - self.started, 0
        while self.queue and self.queue[0].arrival_s <= now:
            req = self.queue.popleft()
            record = self.records[req.req_id]
            record.dispatched_at = time.time()
            leader = self.pd_plan.leaders[self.router.dispatch(req.req_id, len(req.prompt))]
            self.sends.append(self.comm.isend(req, dest=leader, tag=TAG_REQUEST))
            num += 1
        num += self.take_prefilled() + self._take_transfers() + self._take_failover()
        return num + self.watch.poll() + self.decode_loss.poll()

    def take_prefilled(self) -> int:
        num = 0
        while (msg := self.comm.improbe(tag=TAG_PD_PREFILLED)) is not None:
            task = msg.recv()
            if self.virtual is not None:  # it leaves its TE's load at its virtual end
                self.virtual.prefilled(task)
            else:
                self.router.prefilled(task.req.req_id)
            if task.req.req_id not in self.pd_book.transfers:  # the TTFT split: the first one's
                self.pd_book.tasks[task.req.req_id] = task
            self._route(task, is_reroute=False)
            num += 1
        return num

    def _route(self, task, *, is_reroute: bool) -> None:
        """Step 4, around the pairs and dies the link probers found at fault (§6.1)."""
        hard, soft = self.failover.avoid(task.prefill_rank, task.req.req_id)
        to = self.pd_plan.decode_shell  # one decode TE: the JE's choice by load is it
        message = Routed(task=task, hard=hard, soft=soft, is_reroute=is_reroute)
        if self.virtual is not None:  # with the next promise (ranks/shell/pd_pacers.py)
            return self.virtual.route(message)
        if to == 0:  # no decode TE-shell rank: the JE balances the decode groups itself
            self.balancer.on_complete(task.req.req_id)  # a no-op unless routed before
            to = pick_decode(self.balancer, task.req, hard, soft)
            self.balancer.on_dispatch(to, task.req)
            message = task
        self.sends.append(self.comm.isend(message, dest=to, tag=TAG_PD_TASK))

    def route_again(self, task) -> None:
        """A task whose decode die was lost before its KV moved: to another decode die."""
        self._route(task, is_reroute=True)

    def _take_failover(self) -> int:
        """Faults the dies injected (for the records) and the link probers' reports: requests
        withdrawn from a pair found down are cancelled at its decode die and routed again."""
        num = 0
        while (msg := self.comm.improbe(tag=TAG_PD_FAULT_BEGAN)) is not None:
            began = msg.recv()
            self.failover.began[began.row] = began
            num += 1
        while (msg := self.comm.improbe(tag=TAG_PD_VERDICT)) is not None:
            report = msg.recv()
            self.log.warning(
                "link probe: %s on pair %d -> %d (echo %.2f s), requests %s",
                report.kind,
                report.prefill,
                report.decode,
                report.rtt_s,
                list(report.req_ids),
            )
            moved = self.failover.on_report(report)
            if moved:
                self.sends.append(
                    self.comm.isend(list(moved), dest=report.decode, tag=TAG_PD_CANCEL)
                )
            for req_id in moved:
                self._route(self.pd_book.tasks[req_id], is_reroute=True)
            num += 1
        return num

    def failure_records(self) -> list:
        """One record per decode die's stuck/dead row (ranks/recovery/je_decode_loss.py)."""
        recovery = {rank: report.recovery for rank, report in self.reports.items()}
        return self.decode_loss.records(self.records, self.started, recovery)

    def has_failed_over(self) -> bool:
        return bool(self.decode_loss.moved) or super().has_failed_over()

    def take_tokens(self) -> int:
        """A request whose first token ended it at prefill leaves its TE's load here."""
        num = super().take_tokens()
        if self.virtual is not None:  # the pacer applies it at its virtual time
            return num
        for req_id in [r for r in self.router.in_flight() if self.records[r].tokens]:
            self.router.prefilled(req_id)
        return num

    def _take_transfers(self) -> int:
        num = 0
        while (msg := self.comm.improbe(tag=TAG_PD_TRANSFER)) is not None:
            done = msg.recv()
            # a request prefilled again after its decode die was lost moves its KV again:
            # the TTFT split and the /pd group keep its first transfer
            self.pd_book.transfers.setdefault(done.req_id, done)
            self.records[done.req_id].die_rank = done.decode_rank
            if (reason := self.cancel_at_decode.pop(done.req_id, None)) is not None:
                self.cancel(done.req_id, reason)
            num += 1
        return num

    def cancel(self, req_id: int, reason: str) -> None:
        """serve: a request at prefill, or with its KV on the way, has no decode die to drop it
        yet. It stays open (its tokens recorded, the JE's loop and shutdown wait for it) until
        its transfer is done, and is cancelled on its decode die then; or it ends at prefill."""
        record = self.records[req_id]
        if record.dispatched_at and record.die_rank < 0 and not record.finished_at:
            if req_id not in self.cancel_at_decode:
                self.log.info(
                    "serve: request %d (%s) cancelled at prefill: dropped on its "
                    "decode die once its KV is there",
                    req_id,
                    reason,
                )
            self.cancel_at_decode[req_id] = reason
            return
        super().cancel(req_id, reason)

    def projected_times(self, req_id: int) -> tuple[float, float]:
        """TTFT as the PD split projects it (queueing and prefill on the prefill die's clock,
        the KV transfer on the UB link model, the first decode step on the decode die's); TPOT on
        the decode die's clock. nan until the request's KV reached its decode die."""
        _, tpot = super().projected_times(req_id)
        if req_id not in self.pd_book.tasks or req_id not in self.pd_book.transfers:
            return float("nan"), tpot
        return sum(self.pd_book.split_virtual(req_id).values()), tpot

    def prefill_rank(self, req_id: int) -> int:
        task = self.pd_book.tasks.get(req_id)
        return -1 if task is None else task.prefill_rank

    def serve(self) -> None:
        """Once every prefill and decode die is built, the decode groups' run (Frontend.serve,
        whose clock starts then), then the prefill dies' stop and reports."""
        recv_from_each(
            self.comm,
            self.pd_plan.prefill + self.pd_plan.decode,
            tag=TAG_PD_READY,
            timeout_s=self.ctx.cfg.run.timeout_s,
            me="JE",
            event="die ready",
        )
        super().serve()
        self._take_transfers()
        timeout_s = self.ctx.cfg.xccl.poll_timeout_s
        prefill, shell = self.pd_plan.prefill, self.pd_plan.decode_shell
        shell = 0 if self.decode_loss.is_watched else shell  # told first (_finish)
        send_to_each(
            self.comm,
            {p: None for p in prefill + ((shell,) if shell else ())},
            tag=TAG_STOP,
            timeout_s=timeout_s,
            me="JE",
            event="stop",
        )
        self.decode_loss.take_book()
        if self.virtual is not None:  # the decode side's last bounds came before its book
            self.virtual.take_last_bounds()
        self.pd_book.reports = recv_from_each(
            self.comm, prefill, tag=TAG_REPORT, timeout_s=timeout_s, me="JE", event="prefill report"
        )
        if self.ctx.plan.ems is not None:  # the pool ranks report once every prefill die closed
            self.pd_book.ems_reports = recv_from_each(
                self.comm,
                self.ctx.plan.ems.pool,
                tag=TAG_EMS_REPORT,
                timeout_s=timeout_s,
                me="JE",
                event="EMS pool report",
            )
        self.watch.close()
        self.stop_phases.end("prefill dies stopped")
        self._take_failover()
        self._record_failures()

    def _finish(self) -> None:
        """A decode TE-shell that pings the decode dies stops before the dies do: no ping may
        reach a die that has closed (ranks/recovery/decode_loss.py)."""
        self.decode_loss.stop_shell()
        super()._finish()

    def _record_failures(self) -> None:
        """One FailureRecord per injected KV-path fault and per unexplained verdict."""
        times = [t for r in self.records.values() for t in r.token_times]
        roles = {info.rank: info.role for info in self.ctx.topo.ranks}
        rows, now = self.ctx.cfg.faults.events, time.time()
        failures = self.failover.records(rows, roles, times, self.started, now)
        self.pd_book.failures = self.decode_loss.explained(failures, self.started)
        for i, spec in enumerate(rows):
            if roles[spec.die] == "prefill" and spec.kind in ("dead", "stuck"):
                began, loss = self.failover.began.get(i), self.watch.loss_of(spec.die)
                self.pd_book.failures.append(
                    loss_record(spec, began, loss, times, self.started, now)
                )
