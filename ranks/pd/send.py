"""The prefill die's side of the KV transfer (xDeepServe §5.1 steps 3 and 6-8).

`register` keeps a finished prompt's blocks and MTP state under a PD-transfer task; each decode
die's KvPull (its irecv is posted) queues an XCCL isend of the packed latent KV (one transfer in
flight per die when p2p faults can fire, ranks/pd/faults.py);
`progress` polls the send (the completion queue): a completed one frees the blocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ranks.core.context import RankContext
from ranks.core.control import wait_all
from ranks.core.die_io import SHELL
from ranks.core.messages import TAG_REPORT
from ranks.core.tags import TAG_PD_ABORT, TAG_PD_ABORT_ACK
from ranks.faults.kv_transfer import install
from ranks.pd.channel import ChannelFaults
from ranks.pd.faults import (
    MAX_ATTEMPTS,
    KvAbort,
    check_deadline,
    kv_event_id,
    poll_transfer,
)
from ranks.pd.messages import TAG_PD_PULL, TAG_PD_READY, KvPull, PrefillReport
from ranks.recovery.pd_send_failover import SendFailover
from xccl.p2p import P2P, pair_state, resync_pair
from xds_mpi.pd.kv import pack_kv
from xds_mpi.pd.task import PdTask


@dataclass(frozen=True, kw_only=True)
class Outgoing:
    """An isend in flight: its pull, task, handle, packed bytes (kept alive) and start time."""

    pull: KvPull
    task: PdTask
    handle: object
    data: np.ndarray
    started: float


class KvSender:
    def __init__(self, ctx: RankContext, mem, cache, scheduler, pricer) -> None:
        cfg = ctx.cfg
        self.comm, self.rank, self.timeout_s = ctx.comm, ctx.comm.rank, cfg.xccl.poll_timeout_s
        self.cache, self.scheduler, self.pricer = cache, scheduler, pricer
        self.p2p = P2P(mem, ctx.plan.p2p, num_cores=cfg.xccl.num_cores, timeout_s=self.timeout_s)
        self.faults = install(self.p2p, cfg, self.rank, attempts_per_transfer=MAX_ATTEMPTS)
        link = ChannelFaults(cfg, self.rank, "link")  # this die's injected link rows
        self.failover = SendFailover(ctx, link, clock=lambda: pricer.clock.now_ns / 1e9)
        self.held: dict[int, tuple[PdTask, object]] = {}  # req -> (task, MTP state)
        # On the virtual clock a prompt's KV is packed when its task is handed over and its
        # blocks freed then: when a decode die pulls it is decided in wall time, and the
        # prefill scheduler's admissions must not depend on it (docs/virtual_time.md, PD).
        self.packs_at_hand_over = ctx.plan.clock.is_virtual
        self.packed: dict[int, np.ndarray] = {}  # req -> its packed KV (packs_at_hand_over)
        self.pulls: deque[KvPull] = deque()  # posted receives waiting for this die's turn
        self.outgoing: dict[int, Outgoing] = {}  # req -> its send in flight
        self.resyncing = -1  # the decode rank whose KvAbortAck this die waits for
        self.num_sent = self.bytes_sent = self.num_retries = 0
        self.send_wall_s = 0.0
        self.sends: list[MPI.Request] = [self.comm.isend(None, dest=SHELL, tag=TAG_PD_READY)]

    @property
    def num_outstanding(self) -> int:
        return len(self.held)

    def tick(self, iteration: int) -> None:
        """The die reached `iteration`: injected channel faults may begin (ranks/pd/channel.py)."""
        self.failover.tick(iteration)

    def register(self, prefilled, mtp_state, *, assigned, started, now) -> PdTask:
        """Step 3: the task (metadata and the addresses of the KV blocks only)."""
        seq = prefilled.seq
        req_id = seq.req.req_id
        task = PdTask(
            req=seq.req,
            prefill_rank=self.rank,
            slots=tuple(self.scheduler.table.slots(req_id)),
            first_token=prefilled.token,
            drafts=tuple(prefilled.drafts),
            mtp_next_pos=tuple(mtp_state.next_pos) if mtp_state else (),
            mtp_rows=tuple(len(rows) for rows in mtp_state.rows) if mtp_state else (),
            assigned_at=assigned[0],
            prefill_start=started[0],
            prefill_end=now[0],
            queue_v=started[1] - assigned[1],
            prefill_v=now[1] - started[1],
            start_v=started[1],
            end_v=now[1],
        )
        self.held[req_id] = (task, mtp_state)
        if self.packs_at_hand_over:  # the bytes kept, the blocks free for the next prompts
            self.packed[req_id] = pack_kv(task, self.cache, mtp_state)
            self.scheduler.release(seq.req)
        return task

    def take_pulls(self) -> None:
        """Step 7: decode dies posted their irecvs; queue them (and take retry messages)."""
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_PULL)) is not None:
            pull: KvPull = msg.recv()
            self.pulls.append(pull)
            self.num_retries += pull.attempt > 0
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_ABORT)) is not None:
            self._peer_failed(msg.recv())
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_ABORT_ACK)) is not None:
            abort: KvAbort = msg.recv()
            resync_pair(self.p2p, abort.src, abort.dst, abort.state)
            self.resyncing = -1
        self.failover.take_decode_lost(
            self
        )  # a decode die lost (ranks/recovery/pd_send_failover.py)
        self.sends = [r for r in self.sends if not r.Test()]

    def _start_next(self) -> None:
        self.failover.release(self.pulls)
        while self.pulls and self.resyncing < 0 and len(self.outgoing) < self.faults.max_in_flight:
            pull = self.pulls.popleft()
            if self.failover.holds(pull):
                continue  # the link drops it (ranks/recovery/pd_send_failover.py)
            task, mtp_state = self.held[pull.req_id]
            data = self.packed.get(pull.req_id)
            if data is None:
                data = pack_kv(task, self.cache, mtp_state)
            event = kv_event_id(pull.req_id, pull.attempt)
            handle = self.p2p.isend(data, pull.decode_rank, event)
            self.outgoing[pull.req_id] = Outgoing(
                pull=pull, task=task, handle=handle, data=data, started=time.monotonic()
            )

    def progress(self) -> None:
        """Step 8: poll the sends; a completed one frees the prompt's KV blocks."""
        self._start_next()
        for out in list(self.outgoing.values()):
            done = poll_transfer(out.handle)
            if isinstance(done, Exception):
                return self._failed(out)
            if done:
                self._sent(out)
            else:
                check_deadline(
                    out.started, self.timeout_s, self.rank, out.pull.decode_rank, out.pull.req_id
                )
        self._start_next()
        self.failover.watch(self.outgoing)

    def _sent(self, out: Outgoing) -> None:
        del self.outgoing[out.pull.req_id]
        del self.held[out.task.req.req_id]
        if self.packed.pop(out.task.req.req_id, None) is None:
            self.scheduler.release(out.task.req)
        self.num_sent += 1
        self.bytes_sent += out.data.nbytes
        self.send_wall_s += time.monotonic() - out.started

    def _failed(self, out: Outgoing) -> None:
        """This die's send failed: abandon it, tell the decode die our end of the pair."""
        self.p2p.abandon()
        self.outgoing, decode = {}, out.pull.decode_rank
        abort = KvAbort(
            req_id=out.pull.req_id,
            attempt=out.pull.attempt,
            src=self.rank,
            dst=decode,
            state=pair_state(self.p2p, self.rank, decode),
        )
        self.resyncing = decode
        self.sends.append(self.comm.isend(abort, dest=decode, tag=TAG_PD_ABORT))

    def _peer_failed(self, abort: KvAbort) -> None:
        """The decode die's receive failed: abandon our send, resync the pair, answer."""
        self.p2p.abandon()
        self.outgoing = {}
        mine = pair_state(self.p2p, abort.src, abort.dst)
        state = (max(mine[0], abort.state[0]), max(mine[1], abort.state[1]))
        resync_pair(self.p2p, abort.src, abort.dst, state)
        reply = KvAbort(
            req_id=abort.req_id, attempt=abort.attempt, src=abort.src, dst=abort.dst, state=state
        )
        self.sends.append(self.comm.isend(reply, dest=abort.dst, tag=TAG_PD_ABORT_ACK))

    def report(self, num_iterations: int, *, ems: dict | None = None) -> MPI.Request:
        # Ready, aborts and their answers (the decode dies take them in their KV turns); the
        # bound of the KV transfer's waits.
        wait_all(
            self.sends, timeout_s=self.timeout_s, me=f"die rank {self.rank}", event="KV messages"
        )
        self.failover.close()
        report = PrefillReport(
            die_rank=self.rank,
            num_iterations=num_iterations,
            virtual_spent=self.pricer.snapshot(),
            num_sent=self.num_sent,
            bytes_sent=self.bytes_sent,
            send_wall_s=self.send_wall_s,
            num_send_retries=self.num_retries,
            num_faults=self.faults.num_faults,
            ems=ems or {},
        )
        return self.comm.isend(report, dest=SHELL, tag=TAG_REPORT)
