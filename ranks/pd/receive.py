"""The decode DP group's side of the KV transfer (xDeepServe §5.1 steps 5-8).

A PD-transfer task arrives from the JE. Step 6: the group checks its free KV blocks (the whole
reservation: prompt + output + MTP drafts, as the decode scheduler admits) and a batch slot; when
either is short the receive is deferred (the prefill die keeps the blocks: backpressure, counted)
and tried again next step. Otherwise it allocates the blocks, posts an XCCL irecv and tells the
prefill die to send (one receive in flight per die when p2p faults can fire, so a failed one is
retried between two dies alone, ranks/pd/faults.py). Step 8: it polls the receives; a completed
one is unpacked into its own KV slots and the request joins the running batch with its first
token and MTP state.
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
from ranks.pd.messages import (
    TAG_PD_DONE,
    TAG_PD_PULL,
    TAG_PD_READY,
    TAG_PD_TASK,
    TAG_PD_TRANSFER,
    KvPull,
    KvTransferDone,
)
from ranks.recovery.pd_receive_failover import ReceiveFailover
from xccl.errors import XcclError
from xccl.p2p import P2P, pair_state, resync_pair
from xds_mpi.pd.kv import kv_nbytes, unpack_kv
from xds_mpi.pd.task import PdTask
from xds_mpi.plan.kv_link import KvTransferTimes
from xds_mpi.scheduling.scheduler import Emitted, Sequence


@dataclass(kw_only=True)
class Incoming:
    """A task on this decode die: received (wall), deferrals so far, and once posted its irecv
    handle, buffer, KV slots and post time."""

    task: PdTask
    received_at: float
    num_deferred: int = 0
    handle: object = None
    buf: np.ndarray | None = None
    slots: tuple[int, ...] = ()
    posted_at: float = 0.0
    post_at: float = 0.0  # time.monotonic() the irecv is due (a saturated die posts it late)
    completed_at: float = 0.0
    started: float = 0.0  # time.monotonic() of the attempt's post (its deadline)
    attempt: int = 0
    is_resyncing: bool = False  # failed here: waiting for the prefill die's KvAbortAck
    num_faults: int = 0  # attempts that failed on this (the receiving) die


class KvReceiver:
    def __init__(self, ctx: RankContext, mem, scheduler, executor) -> None:
        cfg = ctx.cfg
        self.comm, self.rank, self.cfg, self.log = ctx.comm, ctx.comm.rank, cfg, ctx.log
        self.scheduler, self.executor = scheduler, executor
        self.timeout_s = cfg.xccl.poll_timeout_s
        self.p2p = P2P(mem, ctx.plan.p2p, num_cores=cfg.xccl.num_cores, timeout_s=self.timeout_s)
        self.faults = install(self.p2p, cfg, self.rank, attempts_per_transfer=MAX_ATTEMPTS)
        # Each prefill die's fabric to this die (xds_mpi/plan/kv_link.py): UB, RoCE or VPC.
        self.transfer_times = KvTransferTimes(cfg, ctx.topo, (self.rank,))
        self.decode_shell = ctx.plan.pd.decode_shell
        saturated = ChannelFaults(ctx.cfg, self.rank, "saturated")  # its injected rows
        self.failover = ReceiveFailover(ctx, self, saturated, clock=executor.pricer.clock)
        self.deferred: deque[Incoming] = deque()
        self.posted: dict[int, Incoming] = {}  # receives in flight (or being retried)
        self.first_tokens: list[Emitted] = []  # streamed with the next iteration's tokens
        self.done: list[Incoming] = []  # adopted, first token not yet streamed
        self.num_deferrals = 0  # steps a task waited for KV blocks or a batch slot
        self.num_done_sent = 0  # completion messages to the decode TE-shell
        # On the virtual clock a granted task's KV lands before the die's next iteration: the
        # decode TE-shell granted it once that iteration starts at or after its arrival.
        self.settles = ctx.plan.clock.is_virtual
        self.warned_deferral = False
        # The die is built: the JE starts its clock once every die said so, so TTFT holds no
        # start-up (model build) time.
        self.sends: list[MPI.Request] = [self.comm.isend(None, dest=SHELL, tag=TAG_PD_READY)]

    @property
    def num_outstanding(self) -> int:
        return len(self.deferred) + len(self.posted)

    def step(self) -> None:
        """Take tasks, post what fits (the rest deferred), poll the completion queue."""
        while (msg := self.comm.improbe(source=self.decode_shell, tag=TAG_PD_TASK)) is not None:
            self.take(msg.recv())
        self.failover.step(self.executor.num_iterations)  # dummies, re-routed requests
        self._take_aborts()
        self._post()
        self.failover.post_due()
        self._complete()
        if self.settles:
            self._settle()
        self.sends = [r for r in self.sends if not r.Test()]

    def take(self, task: PdTask) -> None:
        """A task for this die (from the decode TE-shell: routed, or granted on the virtual
        clock)."""
        self.deferred.append(Incoming(task=task, received_at=time.time()))

    def _settle(self) -> None:
        """Virtual clock: wait (bounded, each receive's deadline) until every posted receive
        completed, so a granted request joins the next iteration whatever this machine's
        speed. A task deferred here (no room) would join later than its grant: said once."""
        while self.posted:
            time.sleep(0.0002)
            self._complete()
        if self.deferred and not self.warned_deferral:
            self.warned_deferral = True
            self.log.warning(
                "die rank %d: a granted KV transfer found no room (request %d): it joins "
                "later than the virtual clock decided",
                self.rank,
                self.deferred[0].task.req.req_id,
            )

    def _has_room(self, task: PdTask) -> bool:
        sched = self.scheduler
        busy = len(sched.running) + len(self.posted)
        need = sched._blocks(task.req)
        return busy < sched.max_batch and sched.reserved_blocks + need <= sched.table.num_blocks

    def _post(self) -> None:
        """Step 6, in arrival order: post what fits; defer the rest (backpressure)."""
        while (
            self.deferred
            and len(self.posted) < self.faults.max_in_flight
            and self._has_room(self.deferred[0].task)
        ):
            incoming = self.deferred.popleft()
            task, sched = incoming.task, self.scheduler
            sched.reserved_blocks += sched._blocks(task.req)
            incoming.slots = tuple(sched.table.allocate(task.req.req_id, task.kv_len))
            self._start(incoming)
        if self.deferred and not self._has_room(self.deferred[0].task):
            for incoming in self.deferred:  # backpressure, not waiting for our turn
                incoming.num_deferred += 1
                self.num_deferrals += 1

    def _start(self, incoming: Incoming) -> None:
        """Post the irecv, then ask the prefill die to send (it isends only after this); a
        saturated die asks at once and posts delay_s later
        (ranks/recovery/pd_receive_failover.py)."""
        task, delay_s = incoming.task, self.failover.post_delay_s()
        incoming.handle = None
        if delay_s:
            incoming.post_at = time.monotonic() + delay_s
        else:
            self.post_irecv(incoming)
        self.posted[task.req.req_id] = incoming
        pull = KvPull(req_id=task.req.req_id, decode_rank=self.rank, attempt=incoming.attempt)
        self.sends.append(self.comm.isend(pull, dest=task.prefill_rank, tag=TAG_PD_PULL))

    def post_irecv(self, incoming: Incoming) -> None:
        task = incoming.task
        nbytes = kv_nbytes(task, self.executor.cache, self.cfg.model.hidden)
        incoming.buf = np.empty(nbytes, np.uint8)
        event = kv_event_id(task.req.req_id, incoming.attempt)
        incoming.handle = self.p2p.irecv(incoming.buf, task.prefill_rank, event)
        incoming.posted_at, incoming.started = time.time(), time.monotonic()

    def _complete(self) -> None:
        """Step 8: a completed receive joins the batch with its KV, first token and MTP state."""
        for incoming in list(self.posted.values()):
            if incoming.is_resyncing or incoming.handle is None:
                continue
            done = poll_transfer(incoming.handle)
            if isinstance(done, Exception):
                return self._failed(incoming)
            task = incoming.task
            if not done:
                check_deadline(
                    incoming.started, self.timeout_s, self.rank, task.prefill_rank, task.req.req_id
                )
                continue
            del self.posted[task.req.req_id]
            incoming.completed_at = time.time()
            self._adopt(incoming)
            self.done.append(incoming)

    def _failed(self, incoming: Incoming) -> None:
        """This die's receive failed: abandon it, tell the prefill die our end of the pair."""
        self.p2p.abandon()
        incoming.num_faults += 1
        src = incoming.task.prefill_rank
        abort = KvAbort(
            req_id=incoming.task.req.req_id,
            attempt=incoming.attempt,
            src=src,
            dst=self.rank,
            state=pair_state(self.p2p, src, self.rank),
        )
        incoming.is_resyncing = True
        self.sends.append(self.comm.isend(abort, dest=src, tag=TAG_PD_ABORT))

    def _take_aborts(self) -> None:
        """The prefill die's send failed (KvAbort) or answered ours (KvAbortAck): resync the
        pair, then retry the transfer with the next attempt."""
        for tag in (TAG_PD_ABORT, TAG_PD_ABORT_ACK):
            while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=tag)) is not None:
                abort: KvAbort = msg.recv()
                state, incoming = abort.state, self.posted.get(abort.req_id)
                if incoming is None:
                    raise XcclError(
                        f"die rank {self.rank}: KvAbort for request {abort.req_id} from rank "
                        f"{abort.src}, but no receive of it is in flight"
                    )
                if tag == TAG_PD_ABORT:
                    self.p2p.abandon()
                    mine = pair_state(self.p2p, abort.src, abort.dst)
                    state = (max(mine[0], state[0]), max(mine[1], state[1]))
                    reply = KvAbort(
                        req_id=abort.req_id,
                        attempt=abort.attempt,
                        src=abort.src,
                        dst=abort.dst,
                        state=state,
                    )
                    self.sends.append(self.comm.isend(reply, dest=abort.src, tag=TAG_PD_ABORT_ACK))
                resync_pair(self.p2p, abort.src, abort.dst, state)
                self._retry(incoming)

    def _retry(self, incoming: Incoming) -> None:
        incoming.attempt += 1
        incoming.is_resyncing = False
        task = incoming.task
        self.faults.check_retry(task.req.req_id, incoming.attempt, task.prefill_rank, self.rank)
        self._start(incoming)

    def _adopt(self, incoming: Incoming) -> None:
        task, sched = incoming.task, self.scheduler
        state = unpack_kv(
            task, incoming.buf, self.executor.cache, list(incoming.slots), self.cfg.model.hidden
        )
        if state is not None:
            self.executor.mtp.states[task.req.req_id] = state
        sched.running[task.req.req_id] = Sequence(
            req=task.req,
            tokens=[*task.req.prompt, task.first_token],
            num_prefilled=len(task.req.prompt),
            num_generated=1,
            drafts=task.drafts,
        )
        self.first_tokens.append(
            Emitted(req_id=task.req.req_id, token=task.first_token, is_finished=False)
        )

    def _tell_je(self, incoming: Incoming, first_step_v: float) -> None:
        """The transfer's numbers for the TTFT split; its virtual time is the pair's link's
        (UB, or RoCE/VPC across hardware types) for the prompt's latent cache at the cost shape
        (61 layers + MTP; BF16, the latent in INT8 with scheduler.kv_int8)."""
        task = incoming.task
        transfer_v = self.transfer_times.seconds(task.prefill_rank, self.rank, len(task.req.prompt))
        done = KvTransferDone(
            req_id=task.req.req_id,
            decode_rank=self.rank,
            received_at=incoming.received_at,
            posted_at=incoming.posted_at,
            completed_at=incoming.completed_at,
            nbytes=incoming.buf.nbytes,
            transfer_v=transfer_v,
            num_deferred=incoming.num_deferred,
            num_retries=incoming.attempt,
            num_recv_faults=incoming.num_faults,
            first_step_v=first_step_v,
        )
        self.sends.append(self.comm.isend(done, dest=SHELL, tag=TAG_PD_TRANSFER))

    def completed(self, emitted: list[Emitted], vclock_s: float) -> None:
        """Tell the decode TE-shell (a rank of its own) which requests finished, and the
        die's virtual clock then (the iteration's end: the virtual clock's balancer frees
        their slots at it)."""
        finished = [(e.req_id, vclock_s) for e in emitted if e.is_finished]
        if finished and self.decode_shell:
            self.sends.append(self.comm.isend(finished, dest=self.decode_shell, tag=TAG_PD_DONE))
            self.num_done_sent += 1

    def take_first_tokens(self, first_step_v: float) -> list[Emitted]:
        """The first tokens to stream with this iteration's (which took first_step_v virtual
        seconds); the JE learns each transfer's numbers."""
        for incoming in self.done:
            self._tell_je(incoming, first_step_v)
        tokens, self.first_tokens, self.done = self.first_tokens, [], []
        return tokens

    def drain(self) -> None:
        self.failover.close()
        # Pulls, aborts and news to the prefill dies, the JE and the decode TE-shell: each
        # takes them before its own end (the bound of the KV transfer's waits).
        wait_all(
            self.sends, timeout_s=self.timeout_s, me=f"die rank {self.rank}", event="KV messages"
        )
