"""A die's side of token recomputation (xDeepServe §6.2 stage 3): injected faults in, iterations
re-executed, counters out.

Each iteration runs as an attempt of xccl/recovery/rollback.py's protocol: a die whose XCCL
operation raises an injected fault tells every die (the abort word every wait checks), every die
votes once per attempt, and on a failed vote every die resyncs its XCCL buffers, restores its
state to the start of the iteration (the die's `Recoverable` state: scheduler, KV lengths, MTP
drafts, event ids; its priced time) and runs it again. The virtual clock does not go back: the
failed attempt's time up to its detection (the latest point of a die that faulted: an injected
error's, a timed-out wait's plus `xccl.poll_timeout_s`, a stalled die's return) and the
rollback's price (xds_mpi/plan/failures/rollback_cost.py) stay on every die's clock, as on the
pod, and the re-run starts there. Nothing of a failed attempt reaches the TE-shell: dies commit
and stream only after a vote that passed. With no faults configured nothing of this runs (no
interrupt in the waits, no vote): an iteration is one attempt. What a die counts
(RecoveryCounters) goes to the TE-shell in its report; `describe` names a failed attempt's
faults in words: injected XCCL errors and waits that timed out on a slow peer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from mpi4py import MPI

from xccl.errors import PeerTimeout, XcclError
from xccl.recovery.faults import FaultHook, RecoverableBuffer, RecoveryHooks
from xccl.recovery.rollback import Outcome, Recovery
from xccl.recovery.vote import Fault, FaultReport
from xds_mpi.config.schema import Config
from xds_mpi.execution.faults import EventMap, FaultPlan
from xds_mpi.execution.pricing import Pricer
from xds_mpi.plan.failures.checks import release_bound_s
from xds_mpi.plan.failures.rollback_cost import RollbackCost
from xds_mpi.report import trace

_UNKEPT = nullcontext()  # an iteration with nothing to keep and no trace span


@dataclass
class RecoveryCounters:
    """Per die. rollbacks: failed attempts (the same on every die); recomputed_iterations:
    iterations that needed at least one re-execution; faults_injected: the run's faults
    (filled by `Recomputer.report`: the votes' faults, which a lost die's are among, and those
    of attempts a fence cut short); wall_lost_s / vtime_lost_s: wall and virtual time of the
    failed attempts (virtual: up to the detection, `Recomputer._detected_ns`, plus the
    rollbacks' price; the same on every die).
    timeouts: failed attempts in which some die's wait timed out (faults.on_timeout recompute;
    the same on every die); timeout_die / timeout_peer / timeout_iteration / timeout_wall: the
    first such timeout's waiting die, the die its wait leads to (Outcome.blamed: the die it
    waited for, or the one that die was waiting for, ...), its iteration and the wall time
    (time.time()) of the vote that saw it (-1: none); timeout_via: the die the timed-out wait
    itself named."""

    rollbacks: int = 0
    recomputed_iterations: int = 0
    faults_injected: int = 0
    wall_lost_s: float = 0.0
    vtime_lost_s: float = 0.0
    timeouts: int = 0
    timeout_die: int = -1
    timeout_peer: int = -1
    timeout_via: int = -1
    timeout_iteration: int = -1
    timeout_wall: float = -1.0

    def count_timeouts(self, outcome: Outcome, iteration: int, timed_out_at: float) -> None:
        """A failed vote: one more timed-out attempt if any die's wait timed out.
        timed_out_at: when this die's own wait timed out in this attempt (time.time()), -1 if it
        did not (the vote's time stands in; the earliest over the dies is the timeout's)."""
        timeouts = outcome.timeouts
        if not timeouts:
            return
        self.timeouts += 1
        if self.timeout_wall < 0:
            first = timeouts[0]
            self.timeout_die, self.timeout_via = first.die, first.peer
            self.timeout_peer = outcome.blamed(first)
            self.timeout_iteration = iteration
            # The earliest timeout any die voted (expert dies report their counters to nobody).
            voted = [f.at_us / 1e6 for f in timeouts if f.at_us >= 0]
            fallback = timed_out_at if timed_out_at >= 0 else time.time()
            self.timeout_wall = min(voted, default=fallback)


def describe(outcome: Outcome, events: EventMap) -> str:
    """The faults of a failed attempt: die, operation, MoE layer, event id, and the error code
    or the peer a timed-out wait waited for (and the die the waits lead to, when another)."""
    return (
        "; ".join(
            f"die {f.die} {f.op} at layer {events.layer_of_event(f.event_id)} (event "
            f"{f.event_id}, {_what(f, outcome)})"
            for f in outcome.faults
        )
        or "none reported"
    )


def _what(f: FaultReport, outcome: Outcome) -> str:
    if not f.is_timeout:
        return f"code {f.code}"
    said = f"timed out waiting for die {f.peer}: xccl.poll_timeout_s"
    blamed = outcome.blamed(f)
    return said if blamed == f.peer else f"{said}; the waits lead to die {blamed}"


class RecomputationFailed(XcclError):
    """A fault outlived faults.max_retries re-executions of one iteration."""


class Recoverable(Protocol):
    """Part of a die's state that an iteration changes before it commits (the scheduler, the
    executor with its MTP drafts): put back to the iteration's start after a failed attempt."""

    def checkpoint(self) -> Any: ...

    def restore(self, checkpoint: Any) -> None: ...


class IterationAttempts:
    """One iteration's attempts on one die: where the iteration started (the die's state, the
    virtual clock, the priced time), and the attempt running now. The with-block of the
    iteration (`Recomputer.checkpoint`): it begins attempt 0, and once the block ends without
    an error the iteration is done (a later fence undoes nothing of it).
    first_execution: executions of the iteration before this block (a fence cut them short and
    the dies rebuilt): the fault plan numbers this block's attempts after them, so that a row
    firing on the iteration's first `times` executions does not fire again after a failover."""

    def __init__(
        self,
        iteration: int,
        *,
        plan: FaultPlan,
        pricer: Pricer,
        state: Sequence[Recoverable],
        is_tracing: bool = False,
        first_execution: int = 0,
    ) -> None:
        self.iteration, self.plan, self.pricer = iteration, plan, pricer
        self.first_execution = first_execution
        self.state, self.is_tracing = tuple(state), is_tracing
        self.checkpoints = tuple(part.checkpoint() for part in self.state)
        self.clock_start, self.priced_start = pricer.clock.snapshot(), pricer.snapshot()
        self.attempt, self.started_s, self.vstarted_ns = 0, time.perf_counter(), 0.0
        self.is_done = False
        self.iteration_started_s, self.iteration_vstart_ns = self.started_s, pricer.clock.now_ns

    def __enter__(self) -> IterationAttempts:
        self.begin(0)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.is_tracing:  # the whole iteration, all its attempts (a fence's Released too)
            trace.record(
                "iteration",
                (self.iteration_started_s, time.perf_counter()),
                (self.iteration_vstart_ns, self.pricer.clock.now_ns),
                iteration=self.iteration,
            )
        self.is_done = exc_type is None  # else a fence's Released: restore_interrupted undoes it

    def begin(self, attempt: int) -> None:
        """Attempt `attempt` (0 = the first execution) of the iteration starts."""
        self.attempt, self.started_s = attempt, time.perf_counter()
        self.vstarted_ns = self.pricer.clock.now_ns
        self.plan.begin(iteration=self.iteration, attempt=self.first_execution + attempt)
        if self.is_tracing:
            trace.begin_attempt()

    def ended(self) -> None:
        """A re-executed attempt ended (completed or failed): its trace span."""
        if self.is_tracing and self.attempt > 0:
            trace.record(
                "recompute",
                (self.started_s, time.perf_counter()),
                (self.vstarted_ns, self.pricer.clock.now_ns),
                iteration=self.iteration,
                attempt=self.attempt,
            )

    def wall_s(self) -> float:
        """Wall seconds of the attempt so far."""
        return time.perf_counter() - self.started_s

    def vtime_s(self) -> float:
        """Virtual seconds since the iteration started (the failed attempt's, before restore)."""
        return (self.pricer.clock.now_ns - self.clock_start) / 1e9

    @property
    def num_executions(self) -> int:
        """Executions of the iteration so far, the running one included."""
        return self.first_execution + self.attempt + 1

    def restore(self, *, resume_ns: float | None = None) -> None:
        """The die back to the iteration's start; its virtual clock at `resume_ns` (a failed
        vote: the failed attempt's end and the rollback's price, which the pod pays too) or, when
        None (a fence: the failover is priced from the iteration's start), at the start."""
        self.pricer.clock.restore(self.clock_start if resume_ns is None else resume_ns)
        self.pricer.restore(self.priced_start)
        for part, checkpoint in zip(self.state, self.checkpoints):
            part.restore(checkpoint)


class Recomputer:
    """A die's token recomputation; the die installs it as its `recompute` (the hook the
    decode-die loop reads, ranks/core/decode_die.py DieRecompute) and runs each iteration with
    it, in the open (ranks/colocated/die.py `iteration`):

        with recompute.checkpoint(iteration, state):     # the iteration's start kept
            while True:
                try:
                    result = attempt()
                except recompute.failures as exc:        # () without faults configured
                    recompute.fail(exc)                  # abort word, vote, state restored
                    continue
                if not recompute.is_voting or recompute.vote():
                    break                                # every die completed the attempt
    """

    def __init__(
        self,
        cfg: Config,
        comm: MPI.Comm,
        rank: int,
        buffers: Sequence[RecoverableBuffer],
        pricer: Pricer,
        *,
        events: EventMap,
        log: logging.Logger | None = None,
        window_comm: MPI.Comm | None = None,
        stall: FaultHook | None = None,
    ) -> None:
        """events: how the die's XCCL operations number their events (the fault plan's layers).
        window_comm: the world communicator when the TE-shell fences these dies
        (ranks/recovery/detector.py): the abort words' window then spans it, and the waits
        check the fence even with no fault table. stall: the die's stuck-fault hook, given
        only to a die a stuck row names (ranks/faults/stuck.py), called inside each operation
        before the fault plan's."""
        self.faults = cfg.faults
        self.buffers, self.rank, self.comm, self.pricer = list(buffers), rank, comm, pricer
        self.counters = RecoveryCounters()
        hw = pricer.cost.hw
        self.rollback_ns = 1e9 * (
            RollbackCost.of(
                write_latency_s=hw.write_latency_s, read_latency_s=hw.read_latency_s
            ).total_s
        )
        self._log = log
        self.log = log if comm.rank == 0 else None  # one die tells the story
        self.is_tracing = trace.is_enabled()  # chosen once: no span call when off
        self._last_recomputed = -1
        self._outcome: Outcome | None = None
        self._attempts: IterationAttempts | None = None  # the iteration running now
        # This die's detection point in the running attempt, virtual ns (-inf: none): its own
        # fault, a timed-out wait, or the end of its stall (`_detected_ns`).
        self._detection_ns = -math.inf
        # (iteration, its executions) a fence cut short, carried to its re-run (regroup)
        self._interrupted = (-1, 0)
        # Injected faults the failed votes reported: every die's (a lost die's too, up to its
        # loss), and this die's own among them; the same count on every die of the vote.
        self._faults_voted = self._own_faults_voted = 0
        self.plan = FaultPlan(cfg.faults, rank, events)
        # Transient errors or recomputed timeouts: every iteration is an attempt, and votes.
        self.is_voting = cfg.faults.is_enabled or cfg.faults.on_timeout == "recompute"
        self.recovery = None
        self.failures: tuple[type[XcclError], ...] = ()  # what fails an attempt (none)
        if self.is_voting or window_comm is not None:
            self.recovery = _recovery(cfg, comm, window_comm)
            # The fault plan's check only where a row or the random mode can hit this die.
            check = self.plan.check if self.plan.rows or self.plan.random_ops else None
            stall = None if stall is None else self._marking_stall(stall)
            hook = stall if check is None else check if stall is None else _chain(stall, check)
            hooks = RecoveryHooks(interrupt=self.recovery.interrupt, fault_hook=hook)
            for b in self.buffers:
                b.set_recovery(hooks)
        if self.is_voting:
            self.failures = self.recovery.failures

    def checkpoint(
        self, iteration: int, state: Sequence[Recoverable] = ()
    ) -> AbstractContextManager:
        """The with-block of one iteration: its start (the die's `state`, the virtual clock, the
        priced time) kept while an attempt can fail or the TE-shell's fence interrupt it, so
        that `fail` and `restore_interrupted` go back to it; nothing to keep without either."""
        if self.recovery is None:
            return trace.span("iteration", iteration=iteration) if self.is_tracing else _UNKEPT
        self._detection_ns = -math.inf  # a stall its peers waited out in the last one
        cut_iteration, cut_executions = self._interrupted
        self._attempts = IterationAttempts(
            iteration,
            plan=self.plan,
            pricer=self.pricer,
            state=state,
            is_tracing=self.is_tracing,
            first_execution=cut_executions if iteration == cut_iteration else 0,
        )
        return self._attempts

    def fail(self, exc: XcclError) -> None:
        """The attempt raised one of `failures`: every die told (the abort word), the vote, the
        die restored to the iteration's start and the next attempt begun."""
        fault = self.recovery.failed(exc, self.buffers)
        if fault is not None:  # this die's own: an injected error here, or its wait timed out
            waited_ns = self.recovery.timeout_s * 1e9 if isinstance(fault, PeerTimeout) else 0.0
            self._mark_detection(self.pricer.clock.now_ns + waited_ns)
        self.vote(fault)

    def vote(self, fault: Fault | None = None) -> bool:
        """Every die, once per attempt (faults configured): did every die complete it? After a
        failed vote the die is back at the iteration's start and the next attempt begun; past
        faults.max_retries re-executions RecomputationFailed names the last attempt's faults."""
        attempts = self._attempts
        attempts.ended()
        outcome = self.recovery.settle(fault, self.buffers)
        if not outcome.failed:
            return True
        self._count_faults(outcome)
        self._rolled_back(outcome)
        if attempts.attempt >= self.faults.max_retries:
            raise RecomputationFailed(
                f"die rank {self.rank}: iteration {attempts.iteration} failed "
                f"{self.faults.max_retries + 1} times in a row (faults.max_retries="
                f"{self.faults.max_retries}); the last attempt's faults: "
                f"{describe(self._outcome, self.plan.events)}"
            )
        attempts.begin(attempts.attempt + 1)
        return False

    def restore_interrupted(self) -> None:
        """The die back to the start of the iteration a fence interrupted (none: nothing)."""
        attempts, c = self._attempts, self.counters
        if attempts is not None and not attempts.is_done:
            c.rollbacks += 1
            c.recomputed_iterations += 1
            c.wall_lost_s += attempts.wall_s()
            c.vtime_lost_s += attempts.vtime_s()
            attempts.restore()
            self._interrupted = (attempts.iteration, attempts.num_executions)
            self._attempts = None
            trace.mark_rolled_back()

    def _count_faults(self, outcome: Outcome) -> None:
        """A failed vote's injected faults (a timed-out wait is no injected fault)."""
        injected = [f for f in outcome.faults if not f.is_timeout]
        self._faults_voted += len(injected)
        self._own_faults_voted += sum(1 for f in injected if f.die == self.rank)

    def _rolled_back(self, outcome: Outcome) -> None:
        """Every die's attempt failed: count it, tell it, restore the die."""
        attempts, c = self._attempts, self.counters
        self._outcome = outcome
        c.rollbacks += 1
        timed_out_at = self.recovery.timed_out_at
        c.count_timeouts(outcome, attempts.iteration, timed_out_at)
        self.recovery.timed_out_at = -1.0
        if self._last_recomputed != attempts.iteration:
            c.recomputed_iterations += 1
            self._last_recomputed = attempts.iteration
        resume_ns = max(self._detected_ns(), attempts.vstarted_ns) + self.rollback_ns
        c.wall_lost_s += attempts.wall_s()
        c.vtime_lost_s += (resume_ns - attempts.vstarted_ns) / 1e9
        if self.log is not None and attempts.attempt < self.faults.max_retries:
            self.log.info(
                "iteration %d rolled back (%s); recomputing, attempt %d of %d",
                attempts.iteration,
                describe(outcome, self.plan.events),
                attempts.attempt + 2,
                self.faults.max_retries + 1,
            )
        for f in outcome.faults:
            if f.die == self.rank:
                trace.instant("fault", op=f.op, event=f.event_id, code=f.code)
        started_s = time.perf_counter()
        attempts.restore(resume_ns=resume_ns)
        # On the virtual clock the rollback is its price after the detection, the re-run starts
        # at its end; the failed attempt's spans are flagged.
        trace.record(
            "rollback",
            (started_s, time.perf_counter()),
            (resume_ns - self.rollback_ns, resume_ns),
            iteration=attempts.iteration,
            attempt=attempts.attempt,
        )
        trace.mark_rolled_back()

    def _detected_ns(self) -> float:
        """The failed attempt's end on the virtual clock, the same on every die (collective
        over the vote's dies, after a failed vote): the latest detection point of any die. A
        die whose operation raised an injected error stands at its clock then; a die whose wait
        timed out, xccl.poll_timeout_s past its clock; a die that stalled (ranks/faults/stuck.py,
        priced on its clock) at the stall's end: the vote waits for it. A die the abort word
        interrupted brings nothing: where its wait was cut depends on this machine's speed
        (how many peers' records had landed), not on the pod. -inf when no die has a point."""
        mine, self._detection_ns = self._detection_ns, -math.inf
        return self.comm.allreduce(mine, op=MPI.MAX)

    def _mark_detection(self, at_ns: float) -> None:
        self._detection_ns = max(self._detection_ns, at_ns)

    def _marking_stall(self, stall: FaultHook) -> FaultHook:
        """`stall`, marking where a stall priced on the virtual clock left the die (the clock
        moved while it stalled): the failed attempt it belongs to ends no earlier."""

        def hook(op: str, event_id: int) -> None:
            before_ns = self.pricer.clock.now_ns
            stall(op, event_id)
            if self.pricer.clock.now_ns > before_ns:
                self._mark_detection(self.pricer.clock.now_ns)

        return hook

    def regroup(self, comm: MPI.Comm, buffers: Sequence[RecoverableBuffer]) -> None:
        """Vertical scaling (ranks/recovery/scale_down.py): the survivors' `comm` and their
        rebuilt `buffers` (hooks already installed: EpBuffer/AfdBuffer.rebuilt) from now on.
        The vote moves with them, always: a vote left on a communicator that holds a lost die
        never completes, and every fence that ends it finds the dies stuck in the next one.
        Collective over `comm`."""
        self.comm, self.buffers = comm, list(buffers)
        self.log = self._log if comm.rank == 0 else None  # the story's teller may be lost
        if self.is_voting:
            self.recovery.regroup(comm)
        # A fence may catch the dies one vote apart, and some may have completed the iteration it
        # cut: the highest (iteration, executions) is carried to whichever die re-runs it.
        self._interrupted = comm.allreduce(self._interrupted, op=MPI.MAX)

    def report(self) -> dict:
        """The counters, with faults_injected the run's (collective over the dies: expert dies
        inject faults too but report to nobody): the faults the votes reported, a lost die's
        among them, and each die's faults that reached no vote (their attempt cut short by a
        fence; a lost die's of that attempt are known to nobody)."""
        counters = dict(vars(self.counters))
        unvoted = self.plan.num_fired - self._own_faults_voted
        voted = self.comm.allreduce(self._faults_voted, op=MPI.MAX)
        counters["faults_injected"] = voted + self.comm.allreduce(unvoted)
        return counters

    def free(self) -> None:
        if self.recovery is not None:
            self.recovery.free()


def _chain(*hooks: FaultHook | None) -> FaultHook | None:
    """One fault hook calling each given hook in turn (None: no hook at all)."""
    given = [h for h in hooks if h is not None]
    if not given:
        return None

    def hook(op: str, event_id: int) -> None:
        for h in given:
            h(op, event_id)

    return hook


def _recovery(cfg: Config, comm: MPI.Comm, window_comm: MPI.Comm | None) -> Recovery:
    recover_timeouts = cfg.faults.on_timeout == "recompute"
    return Recovery(
        comm,
        timeout_s=cfg.xccl.poll_timeout_s,
        window_comm=window_comm,
        recover_timeouts=recover_timeouts,
        vote_timeout_s=_vote_timeout_s(cfg, recover_timeouts),
    )


def _vote_timeout_s(cfg: Config, recover_timeouts: bool) -> float:
    """How long a vote waits for every die. With timeouts recomputed, a die whose wait timed out
    votes while its peer may still be lost: the vote outlasts the heartbeats' detection and release
    (xds_mpi/plan/failures/checks.py), so the fence, not a vote timeout, ends it (§6.1 wins)."""
    poll_s = cfg.xccl.poll_timeout_s
    return poll_s + release_bound_s(cfg.health) if recover_timeouts else poll_s
