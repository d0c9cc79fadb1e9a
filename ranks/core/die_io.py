"""A die's control-plane mailboxes: requests and stop in from the TE-shell, tokens out."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field, fields
from typing import Protocol

from mpi4py import MPI

from ranks.core.control import wait_all
from ranks.core.messages import (
    SHELL,
    TAG_CANCEL,
    TAG_REPORT,
    TAG_REQUEST,
    TAG_STOP,
    TAG_TOKENS,
    DieReport,
    TokenBatch,
)
from ranks.core.ready import report_ready
from ranks.core.trace_io import send_trace
from xds_mpi.execution.pricing import IterationTiming
from xds_mpi.report import trace
from xds_mpi.results.record_cap import max_iterations
from xds_mpi.scheduling.scheduler import DieScheduler, Emitted


@dataclass(frozen=True, kw_only=True)
class DieTotals:
    """A decode die's run, for its report to the TE-shell. virtual_spent: operation -> virtual
    seconds (xds_mpi/execution/pricing.py); recovery: the token recomputation counters
    (ranks/recovery/recompute.py, faults_injected summed over every die)."""

    num_iterations: int
    virtual_spent: dict[str, float]
    recovery: dict
    cancelled: dict = field(default_factory=dict)  # serve: requests dropped, KV blocks freed
    ems: dict = field(default_factory=dict)  # the EMS client's counts (colocated, no PD)


class DecodeDie(Protocol):
    """What `serve` drives: a colocated die (ranks/colocated/die.py) or an attention die
    (ranks/afd/attention.py)."""

    outbox: Outbox
    is_lost: bool  # lost (ranks/core/decode_die.py): it leaves without a collective

    def step(self) -> bool:
        """One iteration (or an idle turn); False once every die was told to stop."""

    def totals(self) -> DieTotals:
        """The run's totals (collective over the dies)."""

    def close(self) -> None:
        """Drain the outbox and free the die (collective)."""

    def leave(self) -> None:
        """A lost die's way out: no collective."""


def serve(die: DecodeDie) -> None:
    """A decode die (colocated or attention) after the handshake: iterations until every die was
    told to stop, its report to the TE-shell, then the collective close — only on this way out
    together (an error aborts the job instead of hanging in a collective)."""
    report_ready(die.outbox.comm)
    while die.step():
        pass
    if die.is_lost:  # a lost die (ranks/core/decode_die.py): no collective
        die.leave()
        return
    totals = die.totals()
    die.outbox.report(
        totals.num_iterations, totals.virtual_spent, totals.recovery, totals.cancelled, totals.ems
    )
    send_trace(die.outbox.comm, timeout_s=die.outbox.timeout_s)
    die.close()


class Inbox:
    def __init__(self, comm: MPI.Comm, scheduler: DieScheduler) -> None:
        self.comm, self.scheduler = comm, scheduler
        self.is_stopped = False
        self.cancelled: set[int] = set()  # dropped since the last `take_cancelled`
        self.early_cancels: set[int] = set()  # cancels whose request has not been seen here

    def poll(self) -> None:
        """Take every request that has arrived, drop the cancelled ones; note a stop."""
        while (message := self.comm.improbe(source=SHELL, tag=TAG_CANCEL)) is not None:
            self.early_cancels.add(message.recv())
        while (message := self.comm.improbe(source=SHELL, tag=TAG_REQUEST)) is not None:
            for req in message.recv():  # the TE-shell's turn: one message per die
                with trace.span("request", req_id=req.req_id):
                    trace.flow_end(req.req_id, "request")  # the arrow from the TE-shell
                    self.scheduler.add(req)
        # MPI orders messages of one tag only: a cancel may be matched before its request.
        # It waits for it here (one that came after its request finished waits for ever: an id).
        for req_id in list(self.early_cancels):
            if self.scheduler.cancel(req_id):
                self.early_cancels.discard(req_id)
                self.cancelled.add(req_id)
        if not self.is_stopped:
            message = self.comm.improbe(source=SHELL, tag=TAG_STOP)
            if message is not None:
                message.recv()
                self.is_stopped = True

    def take_cancelled(self) -> set[int]:
        """The requests dropped since the last call (the executor forgets their MTP state)."""
        taken, self.cancelled = self.cancelled, set()
        return taken


class Outbox:
    """clock: with run.clock virtual, the die's VirtualClock, whose time each token batch
    carries (its clock warps and waits for the others between iterations); None: the sum of
    the iterations' virtual times."""

    def __init__(self, comm: MPI.Comm, rank: int, *, timeout_s: float, clock=None) -> None:
        self.comm, self.rank, self.timeout_s = comm, rank, timeout_s
        self.clock = clock
        self.pending: list[MPI.Request] = []
        # One entry per iteration, until the stop (the run file's /dies): as arrays of 8-byte
        # numbers, ~80 bytes an iteration, against ~240 as lists of Python floats.
        self.timings: dict[str, array] = {
            f.name: array("q" if f.type == "int" else "d") for f in fields(IterationTiming)
        }
        # `xds-mpi serve --max-iterations` (0: all): past it the oldest half goes, so that a
        # served die's memory stays bounded however long it serves
        self.max_timings = max_iterations()
        self.num_timings_dropped = 0
        self.num_iterations = 0
        self.num_batches = 0  # token batches sent (vertical scaling waits for all of them)
        self.vclock_s = 0.0  # the die's 910C virtual clock: its iterations' vtime_s summed

    def stream(self, emitted: list[Emitted], timing: IterationTiming) -> None:
        """Send this iteration's tokens, with the MTP drafts each decode step verified, straight
        to the TE-shell (the output shortcut)."""
        self.num_iterations += 1
        self.vclock_s += timing.vtime_s
        if self.clock is not None:
            self.vclock_s = self.clock.now_ns / 1e9
        for name in self.timings:
            self.timings[name].append(getattr(timing, name))
        if self.max_timings and len(self.timings["vtime_s"]) > self.max_timings:
            drop = len(self.timings["vtime_s"]) - self.max_timings // 2
            for values in self.timings.values():
                del values[:drop]
            self.num_timings_dropped += drop
        if emitted:
            batch = TokenBatch(
                die_rank=self.rank,
                iteration=self.num_iterations,
                wall_time=time.time(),
                tokens=tuple((e.req_id, e.token, e.is_finished) for e in emitted),
                steps=tuple(e.step for e in emitted if e.step),
                vclock_s=self.vclock_s,
                iteration_s=timing.total_s,
                xccl_s=timing.xccl_s,
            )
            self.pending.append(self.comm.isend(batch, dest=SHELL, tag=TAG_TOKENS))
            self.num_batches += 1
        self.pending = [r for r in self.pending if not r.Test()]

    def report(
        self,
        num_iterations: int,
        virtual_spent: dict[str, float],
        recovery: dict | None = None,
        cancelled: dict | None = None,
        ems: dict | None = None,
    ) -> None:
        report = DieReport(
            die_rank=self.rank,
            num_iterations=num_iterations,
            timings=self.timings,
            virtual_spent=virtual_spent,
            recovery=recovery or {},
            cancelled=cancelled or {},
            ems=ems or {},
            num_timings_dropped=self.num_timings_dropped,
        )
        self.pending.append(self.comm.isend(report, dest=SHELL, tag=TAG_REPORT))

    def drain(self) -> None:
        me, event = f"die rank {self.rank}", f"messages to the TE-shell (rank {SHELL})"
        wait_all(self.pending, timeout_s=self.timeout_s, me=me, event=event)
        self.pending = []
