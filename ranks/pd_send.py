"""The prefill die's side of the KV transfer (xDeepServe §5.1 steps 3 and 6-8).

`register` keeps a finished prompt's blocks and MTP state under a PD-transfer task; `take_pulls`
answers each decode die's KvPull (its irecv is posted) with an XCCL isend of the packed latent
KV; `progress` polls the sends (the completion queue): a completed one frees the blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ranks.context import RankContext
from ranks.die_io import SHELL
from ranks.messages import TAG_REPORT
from ranks.pd_messages import TAG_PD_PULL, KvPull, PrefillReport
from xds_mpi.engine.pd_kv import PdTask, pack_kv


def kv_event_id(req_id: int, attempt: int) -> int:
    """The p2p event id of a request's KV transfer (one per attempt: a retried transfer can
    never be taken for the failed one)."""
    return req_id * 64 + attempt


@dataclass(frozen=True, kw_only=True)
class Outgoing:
    """An isend in flight: its task, handle, packed bytes (kept alive) and start time."""

    task: PdTask
    handle: object
    data: np.ndarray
    started: float


class KvSender:
    def __init__(self, ctx: RankContext, mem, cache, scheduler, pricer) -> None:
        from xccl.p2p import P2P

        cfg = ctx.cfg
        self.comm, self.rank = ctx.comm, ctx.comm.rank
        self.cache, self.scheduler, self.pricer = cache, scheduler, pricer
        self.p2p = P2P(
            mem, ctx.plan.p2p, num_cores=cfg.xccl.num_cores, timeout_s=cfg.xccl.poll_timeout_s
        )
        self.held: dict[int, tuple[PdTask, object]] = {}  # req -> (task, MTP state)
        self.outgoing: dict[int, Outgoing] = {}
        self.num_sent = self.bytes_sent = self.num_retries = 0
        self.send_wall_s = 0.0

    @property
    def num_outstanding(self) -> int:
        return len(self.held) + len(self.outgoing)

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
        )
        self.held[req_id] = (task, mtp_state)
        return task

    def take_pulls(self) -> None:
        """Step 7: a decode die posted its irecv; isend the packed KV (a copy of the blocks)."""
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_PULL)) is not None:
            pull: KvPull = msg.recv()
            task, mtp_state = self.held[pull.req_id]
            data = pack_kv(task, self.cache, mtp_state)
            handle = self.p2p.isend(data, pull.decode_rank, kv_event_id(pull.req_id, pull.attempt))
            self.outgoing[pull.req_id] = Outgoing(
                task=task, handle=handle, data=data, started=time.perf_counter()
            )

    def progress(self) -> None:
        """Step 8: poll the sends; a completed one frees the prompt's KV blocks."""
        for req_id, out in list(self.outgoing.items()):
            if not out.handle.test():
                continue
            del self.outgoing[req_id]
            del self.held[req_id]
            self.scheduler.release(out.task.req)
            self.num_sent += 1
            self.bytes_sent += out.data.nbytes
            self.send_wall_s += time.perf_counter() - out.started

    def report(self, num_iterations: int) -> MPI.Request:
        report = PrefillReport(
            die_rank=self.rank,
            num_iterations=num_iterations,
            virtual_spent=self.pricer.snapshot(),
            num_sent=self.num_sent,
            bytes_sent=self.bytes_sent,
            send_wall_s=self.send_wall_s,
            num_send_retries=self.num_retries,
        )
        return self.comm.isend(report, dest=SHELL, tag=TAG_REPORT)
