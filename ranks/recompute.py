"""A die's side of token recomputation (xDeepServe §6.2 stage 3): injected faults in, iterations
re-executed, counters out.

Each iteration runs as an attempt of xccl/recovery.py's protocol: a die whose XCCL operation
raises an injected fault tells every die (the abort word every wait checks), every die votes once
per attempt, and on a failed vote every die resyncs its XCCL buffers, restores its state to the
start of the iteration (the caller's `restore`: scheduler, KV lengths, MTP drafts, event ids,
virtual clock) and runs it again. Nothing of a failed attempt reaches the TE-shell: dies commit
and stream only after a vote that passed. With no faults configured nothing of this runs (no
interrupt in the waits, no vote): an iteration is one attempt.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from mpi4py import MPI

from xccl.errors import RetriesExhausted, XcclError
from xccl.recovery import Outcome, Recovery
from xds_mpi.config import Config
from xds_mpi.engine.pricing import Pricer
from xds_mpi.faults import FaultPlan

T = TypeVar("T")


class RecomputationFailed(XcclError):
    """A fault outlived faults.max_retries re-executions of one iteration."""


@dataclass
class RecoveryCounters:
    """Per die. rollbacks: failed attempts (the same on every die); recomputed_iterations:
    iterations that needed at least one re-execution; faults_injected: faults raised on this
    die; wall_lost_s / vtime_lost_s: wall and virtual time of the failed attempts."""

    rollbacks: int = 0
    recomputed_iterations: int = 0
    faults_injected: int = 0
    wall_lost_s: float = 0.0
    vtime_lost_s: float = 0.0


class Recomputer:
    def __init__(self, cfg: Config, comm: MPI.Comm, rank: int, buffers: Sequence,
                 pricer: Pricer, *, log: logging.Logger | None = None) -> None:
        self.faults = cfg.faults
        self.buffers, self.rank, self.comm = list(buffers), rank, comm
        self.pricer, self.clock = pricer, pricer.clock
        self.counters = RecoveryCounters()
        self.log = log if comm.rank == 0 else None          # one die tells the story
        self._last_recomputed = -1
        self._outcome: Outcome | None = None
        self.plan = FaultPlan(cfg.faults, rank)
        self.recovery = (Recovery(comm, timeout_s=cfg.xccl.poll_timeout_s)
                         if cfg.faults.is_enabled else None)
        if self.recovery is not None:
            for b in self.buffers:
                b.interrupt = self.recovery.interrupt

    def run(self, iteration: int, attempt: Callable[[int], T], *,
            layer_of: Callable[[int], int],
            checkpoint: Callable[[], Callable[[], None]] | None = None) -> T:
        """attempt(k) (k = 0 the first execution) until every die completed one. checkpoint()
        saves the die's own state and returns what puts it back; between attempts that runs,
        after the virtual clock and the per-operation virtual time went back here."""
        if self.recovery is None:
            return attempt(0)
        restore_die = checkpoint() if checkpoint is not None else (lambda: None)
        vstart, spent = self.clock.now_ns, dict(self.pricer.spent)
        started = [time.perf_counter()]
        tried = [0]                                         # the attempt running now

        def one(k: int) -> T:
            for b in self.buffers:
                b.fault_hook = self.plan.hook(iteration=iteration, attempt=k, layer_of=layer_of)
            started[0] = time.perf_counter()
            tried[0] = k
            return attempt(k)

        def restore() -> None:
            self.clock.now_ns = vstart
            self.pricer.spent.clear()
            self.pricer.spent.update(spent)
            restore_die()

        def rolled_back(outcome: Outcome) -> None:
            self._outcome = outcome
            c = self.counters
            c.rollbacks += 1
            if self._last_recomputed != iteration:
                c.recomputed_iterations += 1
                self._last_recomputed = iteration
            c.wall_lost_s += time.perf_counter() - started[0]
            c.vtime_lost_s += (self.clock.now_ns - vstart) / 1e9
            if self.log is not None and tried[0] < self.faults.max_retries:
                self.log.info("iteration %d rolled back (%s); recomputing, attempt %d of %d",
                              iteration, describe(outcome.faults, layer_of), tried[0] + 2,
                              self.faults.max_retries + 1)
            restore()

        try:
            result = self.recovery.run(one, self.buffers, max_retries=self.faults.max_retries,
                                       what=f"iteration {iteration}", on_rollback=rolled_back)
        except RetriesExhausted as exc:
            raise RecomputationFailed(
                f"die rank {self.rank}: iteration {iteration} failed {self.faults.max_retries + 1}"
                f" times in a row (faults.max_retries={self.faults.max_retries}); the last "
                f"attempt's faults: {describe(self._outcome.faults, layer_of)}") from exc
        finally:
            self.counters.faults_injected = self.plan.num_fired
        return result

    def report(self) -> dict:
        """The counters, with faults_injected summed over every die (collective over the dies:
        expert dies inject faults too but report to nobody)."""
        counters = dict(vars(self.counters))
        counters["faults_injected"] = self.comm.allreduce(counters["faults_injected"])
        return counters

    def free(self) -> None:
        if self.recovery is not None:
            self.recovery.free()


def describe(faults, layer_of: Callable[[int], int]) -> str:
    """The faults of a failed attempt: die, operation, MoE layer, event id and error code."""
    return "; ".join(f"die {f.die} {f.op} at layer {layer_of(f.event_id)} (event {f.event_id}, "
                     f"code {f.code})" for f in faults) or "none reported"


def decode_checkpoint(scheduler, executor) -> Callable[[], None]:
    """A decode die's iteration start (scheduler: admissions, prompt progress, KV table;
    executor: iteration number, staged MTP state) and what puts it back."""
    saved = scheduler.checkpoint(), executor.checkpoint()

    def restore() -> None:
        scheduler.restore(saved[0])
        executor.restore(saved[1])
    return restore
