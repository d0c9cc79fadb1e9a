"""A prefill die's side of virtual-time serving (run.clock virtual with PD, docs/virtual_time.md).

The dies of one prefill TE run every iteration together (each MoE layer meets at dispatch and
combine), so they also start it together. The JE grants every die of the TE a horizon, and the
TE's leader the requests it routed to the TE with their decision times: their virtual arrival
in the TE's pool. Between iterations the TE's dies agree, in the two allreduces that replace the
wall clock's one (ranks/pd/prefill.py `_agree`), on the common start (the latest clock: no die's
work is left behind), the earliest horizon (a die that has not taken the newest grant holds the
older one), the earliest arrival in the pool, the oldest and newest grant taken, and the
messages the TE sent the JE so far. The TE runs an iteration when it has requests on its dies or
in its pool by the start; an idle TE whose pool holds only later arrivals starts at the first of
them (it idled until then); it runs only when that start is before the horizon
(xds_mpi/scheduling/admission.py `may_start`). The leader hands out only the requests that
arrived by the start.

The leader reports to the JE once per grant, when every die of the TE has taken it and the TE
is idle or parked at the horizon (`ClockReport`: its start and the TE's messages to the JE, which
the JE takes before it decides). A prefill die never leaves the agreement: a TE is two to a few
dies that meet in one allreduce per turn, pausing a millisecond while they may not run.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from ranks.core.control import wait_all
from ranks.core.messages import SHELL
from ranks.core.vtime_messages import TAG_VTIME_CLOCK, TAG_VTIME_GRANT, ClockReport
from xds_mpi.scheduling.admission import from_words, may_start, to_word


class PrefillVirtualTime:
    def __init__(self, comm: MPI.Comm, group: MPI.Comm, clock, *, is_leader: bool) -> None:
        self.comm, self.group, self.clock, self.is_leader = comm, group, clock, is_leader
        self.seq, self.horizon_s = 0, 0.0  # grant 0: nothing granted before the first report
        self.start_ns = 0.0  # the TE's next iteration's virtual start, from the last agreement
        self.may_run = False
        self.num_sent = 0  # this die's messages to the JE (PD-transfer tasks, token batches)
        self.reported_seq = -1
        self.pending: list[MPI.Request] = []

    def take_grants(self, pool, pooled_v: dict[int, float]) -> None:
        """The JE's grants: the leader's requests join the TE's pool at their decision times;
        the horizon moves on. Taken before the agreement only."""
        while (message := self.comm.improbe(source=SHELL, tag=TAG_VTIME_GRANT)) is not None:
            grant = message.recv()
            for req, t_s in zip(grant.requests, grant.times, strict=True):
                pool.append(req)
                pooled_v[req.req_id] = t_s
            self.seq, self.horizon_s = grant.seq, grant.horizon_s

    def agree(self, counts: np.ndarray, next_pool_s: float) -> np.ndarray:
        """counts: the wall clock's [pending in the pool, requests on the dies, KV transfers
        outstanding, dies not told to stop]; next_pool_s: the leader's earliest pool arrival (inf:
        none, or not the leader). Their sums over the TE's dies; sets `start_s` and `may_run`."""
        sums = np.empty(len(counts) + 1, dtype=np.int64)
        mine = np.array([*counts, self.num_sent], dtype=np.int64)
        self.group.Allreduce(mine, sums, op=MPI.SUM)
        # One MAX reduction: earliest times and the oldest grant as negated words (a word
        # orders as its time, xds_mpi/scheduling/admission.py `to_word`).
        words = np.array(
            [
                to_word(self.clock.now_ns),
                -to_word(self.horizon_s),
                -to_word(next_pool_s),
                self.seq,
                -self.seq,
            ],
            dtype=np.int64,
        )
        top = np.empty_like(words)
        self.group.Allreduce(words, top, op=MPI.MAX)
        latest_ns, horizon, next_pool = from_words(np.array([top[0], -top[1], -top[2]]))
        pending, active = int(sums[0]), int(sums[1])
        is_busy = bool(active or pending)
        if not active and pending and next_pool * 1e9 > latest_ns:
            self.start_ns = float(next_pool) * 1e9  # idle until the pool's first arrival
        else:
            self.start_ns = float(latest_ns)
        self.may_run = is_busy and may_start(self.start_s, float(horizon))
        if self.is_leader and int(top[3]) == -int(top[4]) == self.seq:
            if not is_busy or not self.may_run:
                self._report(is_idle=not is_busy, num_sent=int(sums[-1]))
        return sums[:-1]

    @property
    def start_s(self) -> float:
        return self.start_ns / 1e9

    def begin(self) -> None:
        """The iteration about to run starts at the TE's common virtual start."""
        self.clock.arrive(self.start_ns)

    def eligible(self, req_id: int, pooled_v: dict[int, float]) -> bool:
        """Has the leader's pooled request arrived by the iteration's start?"""
        return pooled_v.get(req_id, -math.inf) * 1e9 <= self.start_ns  # as start_ns was made

    def _report(self, *, is_idle: bool, num_sent: int) -> None:
        if self.reported_seq == self.seq:
            return
        report = ClockReport(
            die_rank=self.comm.rank,
            seq=self.seq,
            start_s=self.start_s,
            is_idle=is_idle,
            num_batches=num_sent,
        )
        self.pending.append(self.comm.isend(report, dest=SHELL, tag=TAG_VTIME_CLOCK))
        self.pending = [r for r in self.pending if not r.Test()]
        self.reported_seq = self.seq

    def drain(self, timeout_s: float) -> None:
        me, event = f"die rank {self.comm.rank}", f"clock reports to the JE (rank {SHELL})"
        wait_all(self.pending, timeout_s=timeout_s, me=me, event=event)
        self.pending = []
