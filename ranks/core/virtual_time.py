"""A die's side of virtual-time serving (run.clock virtual, docs/virtual_time.md), shared by the
colocated dies (ranks/colocated/die.py) and the afd attention and expert dies (ranks/afd/).

The dies that run an iteration together also start it together: each die puts its clock and its
horizon into the agreement between iterations, and every die then knows the same common start
(the latest clock: no die's work of the last iteration is left behind) and the same horizon (the
earliest: a die that has not taken the TE-shell's newest grant holds the older one). They run the
iteration only when it starts before that horizon (xds_mpi/scheduling/admission.py `may_start`),
at that start (`AgreedClock`). A die that takes requests (`DieVirtualTime`: a colocated die, an
afd attention die) otherwise is parked, and tells the TE-shell once per grant where it stands
(`report`), until the next grant raises the horizon. A die with no request of its own reports at
once: it emits nothing until it is given work, so the TE-shell need not wait for its clock.

A parked die, or one that saw every die idle, waits for its next grant out of the agreement
(`is_held`): no die can start an iteration before it has taken that grant (its horizon, or its
lack of work, holds every die back), so the others lose nothing, and it answers heartbeats and
checks the fence every turn instead of waiting in agreement rounds for peers that sleep.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from mpi4py import MPI

from ranks.core.control import WaitTimeout, wait_all
from ranks.core.messages import SHELL
from ranks.core.vtime_messages import TAG_VTIME_CLOCK, TAG_VTIME_GRANT, ClockReport
from xccl.agreement import IdleBackoff
from xccl.vclock import VirtualClock
from xds_mpi.report import trace
from xds_mpi.scheduling.admission import from_words, may_start, to_word

if TYPE_CHECKING:
    from xds_mpi.scheduling.scheduler import DieScheduler


class AgreedClock:
    """A die's clock in the dies' agreement: its words (clock, horizon), the common start and
    horizon every die computes from the same rows, and the move to that start. horizon_s: this
    die's horizon (a die that takes no request, an afd expert die: inf, so that the earliest
    horizon is the request-taking dies')."""

    def __init__(self, clock: VirtualClock, *, horizon_s: float = 0.0) -> None:
        self.clock, self.horizon_s = clock, horizon_s
        self.seq = 0  # the newest grant taken (a die that takes none: 0)
        self.start_ns, self.agreed_horizon_s = 0.0, 0.0  # from the last agreement
        self.one_grant = True  # every die had taken the same grant at the last agreement

    def words(self) -> tuple[int, int]:
        """This die's part of the agreement: its clock (ns) and its horizon (s), as words."""
        return to_word(self.clock.now_ns), to_word(self.horizon_s)

    def agreed(self, words, *, grants) -> None:
        """words: [num_dies, 2] every die's `words` of this round; grants: the newest grant
        each die that takes grants had taken."""
        values = from_words(words)
        self.start_ns = float(values[:, 0].max())
        self.agreed_horizon_s = float(values[:, 1].min())
        self.one_grant = bool(grants.min() == grants.max())

    @property
    def start_s(self) -> float:
        """The virtual start of the dies' next iteration, seconds."""
        return self.start_ns / 1e9

    def may_run(self) -> bool:
        """May the dies start their next iteration (before the horizon)?"""
        return may_start(self.start_s, self.agreed_horizon_s)

    def begin(self) -> None:
        """The iteration about to run starts at the dies' common virtual start."""
        self.clock.arrive(self.start_ns)

    def failed_over(self, cost_s: float) -> float:
        """A failover (ranks/recovery/scale_down.py) rebuilt this die: its clock moves past the
        failover's priced cost (xds_mpi/plan/failures/loss.py FailoverCost), so that the dies'
        next common start is the fault plus the cost. Returns the clock before, seconds: where
        the fault found the die (its last iteration boundary, or the start of the iteration the
        fence interrupted, once restored)."""
        before_s = self.clock.now_ns / 1e9
        self.clock.advance(cost_s * 1e9)
        return before_s


class DieVirtualTime(AgreedClock):
    """A die that takes requests, in grants from the TE-shell (ranks/shell/virtual_time.py)."""

    def __init__(
        self,
        comm: MPI.Comm,
        clock: VirtualClock,
        scheduler: DieScheduler,
        *,
        timeout_s: float,
        shell: int = SHELL,
        take=None,
    ) -> None:
        """shell: the rank that grants (PD's decode dies: the decode TE-shell); take: what a
        granted request becomes on this die (default: the scheduler's waiting queue; PD: a KV
        transfer to post, ranks/pd/decode.py)."""
        super().__init__(clock)
        self.comm, self.scheduler = comm, scheduler
        self.rank, self.timeout_s, self.shell = comm.rank, timeout_s, shell
        self.take = take or scheduler.add
        self.seq, self.horizon_s = 0, 0.0  # grant 0: nothing granted before the first report
        self.reported_seq = -1
        self.admitted: list[tuple[int, float]] = []  # since the last report
        self.waiting_ids: list[int] = []  # before the running iteration
        self.held_since: float | None = None  # time.monotonic(); None: not held
        self.pending: list[MPI.Request] = []
        self.pause = IdleBackoff(first_s=0.0005, last_s=0.004)  # while held

    def take_grants(self) -> None:
        """The TE-shell's grants: their requests join the waiting queue, the horizon moves on, an
        idle die's clock warps. Taken before the agreement only: what the dies agree on is the
        horizon each holds then."""
        while (message := self.comm.improbe(source=self.shell, tag=TAG_VTIME_GRANT)) is not None:
            grant = message.recv()
            for req in grant.requests:  # (PD: PdTasks)
                with trace.span("request", req_id=req.req_id):
                    trace.flow_end(req.req_id, "request")  # the arrow from the TE-shell
                    self.take(req)
            self.seq, self.horizon_s = grant.seq, grant.horizon_s
            if grant.warp_s > -math.inf:
                self.clock.arrive(grant.warp_s * 1e9)
            self.held_since = None

    def after_agree(self, is_busy: bool, num_batches: int) -> bool:
        """After the agreement: report where this die stands (once per grant); True when the
        dies may not start an iteration now (no die has work, or the start is not before the
        horizon): this die is then held until its next grant."""
        self.report(num_batches)
        if is_busy and self.may_run():
            return False
        if not self.one_grant:
            # Some die has not taken the newest grant yet: it is on its way to that die, and the
            # TE-shell sends the next one only once that die has reported, so no die waits for a
            # grant of its own: all meet again in the next agreement, the late die with its grant.
            return True
        self.held_since = time.monotonic()
        return True

    def is_held(self, is_stopped: bool) -> bool:
        """Still waiting for the next grant (called after `take_grants`)? A stop releases the
        die into the agreement, where the dies leave together. Bounded while a request is
        still to come (a finite horizon)."""
        if self.held_since is None or is_stopped:
            self.held_since = None
            self.pause.busy()
            return False
        if self.horizon_s < math.inf and time.monotonic() - self.held_since > self.timeout_s:
            raise WaitTimeout(
                f"die rank {self.rank}: held at virtual {self.start_s:.6f} s (horizon "
                f"{self.agreed_horizon_s:.6f} s, own grant {self.seq}): no grant from the "
                f"TE-shell (rank {self.shell}) after {self.timeout_s:g} s"
            )
        self.pause.idle()
        return True

    def report(self, num_batches: int) -> None:
        """After the agreement, once per grant: tell the TE-shell where this die stands when it
        reached its horizon or has no work of its own (num_batches: token batches sent)."""
        is_idle = self.scheduler.num_active == 0
        if self.reported_seq == self.seq or not (is_idle or self.start_s >= self.horizon_s):
            return
        report = ClockReport(
            die_rank=self.rank,
            seq=self.seq,
            start_s=self.start_s,
            is_idle=is_idle,
            num_batches=num_batches,
            admitted=tuple(self.admitted),
        )
        self.pending.append(self.comm.isend(report, dest=self.shell, tag=TAG_VTIME_CLOCK))
        self.pending = [r for r in self.pending if not r.Test()]
        self.reported_seq, self.admitted = self.seq, []

    def failed_over(self, cost_s: float) -> float:
        """`AgreedClock.failed_over`, and the die parks at the clock it moved to, so that the
        TE-shell decides the lost dies' requests at the virtual time the failover completed
        (the dies' next common start)."""
        before_s = super().failed_over(cost_s)
        self.horizon_s = min(self.horizon_s, self.clock.now_ns / 1e9)
        return before_s

    def begin(self) -> None:
        """The iteration about to run starts at the dies' common virtual start."""
        super().begin()
        self.waiting_ids = [req.req_id for req in self.scheduler.waiting]

    def end(self) -> None:
        """After the iteration: the requests it admitted, admitted at its start."""
        still = {req.req_id for req in self.scheduler.waiting}
        self.admitted += [(r, self.start_s) for r in self.waiting_ids if r not in still]

    def drain(self) -> None:
        """Complete the reports sent (bounded)."""
        me, event = f"die rank {self.rank}", f"clock reports to the TE-shell (rank {self.shell})"
        wait_all(self.pending, timeout_s=self.timeout_s, me=me, event=event)
        self.pending = []
