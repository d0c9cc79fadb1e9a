"""Token recomputation on transient XCCL errors (xDeepServe §6.2 stage 3): abort, vote, re-align.

An attempt (one iteration of the caller) completes on every die or is re-executed on every die:
  1. A die whose operation raised InjectedFault calls notify(): it writes epoch + 1 into every
     die's abort word (one 8-byte word per die, in a window of its own) and flushes.
  2. Every XCCL wait calls interrupt() on each turn (the buffers' `interrupt` attribute): a local
     load of the die's own word; word > epoch raises RollbackRequested. A die waiting for a record
     the faulted die will never publish leaves its wait within a turn instead of at its timeout.
  3. Every die calls vote() exactly once per attempt, whether its attempt raised or completed:
     one allgather of (fault, publication states). The attempt failed if any die reported a fault
     (or notified); then epoch += 1 on every die, and Outcome.states, the element-wise max of the
     dies' publication states, is what every buffer resyncs to (xccl/recovery/faults.py).
  4. On failure every die resyncs its buffers, restores its own state and runs the attempt again.

Why the word is never cleared: its value only grows, and equals the epoch that follows the failed
attempt. Every notify of an attempt writes the same value (concurrent faults on several dies
write epoch + 1 twice: harmless) and is flushed before its die votes, hence before any die leaves
the vote; so no notify of an old attempt can land during a later one, and once the vote moved
epoch up to the word, interrupt() is quiet until a later attempt fails and writes epoch + 1 again.

Why a die that finished its attempt before the fault still rolls back: it may have completed
every operation (e.g. expert dies whose last E2A record was written before an attention die's
fault) and never sees the interrupt, since it waits for nothing more. The vote, not the
interrupt, decides: every die learns there whether any die failed, and all of them re-execute,
so all dies stay in the same iteration with the same publication numbers.

A wait that times out (PeerTimeout, xccl.poll_timeout_s) is such a fault too when the caller
asks for it (recover_timeouts): the late peer was slow, not necessarily gone, so the die notifies
and votes like one whose operation raised, and the iteration is recomputed. A lost peer never
votes: the vote waits up to vote_timeout_s, and the TE-shell's fence (below) ends that wait first.

The TE-shell's release (xDeepServe §6.1, ranks/recovery/detector.py) rides the same window: word 1
of each die's window is the fence, which only the TE-shell writes (the window then spans the world
communicator, the TE-shell holding no words). interrupt() checks it first; a fence above the
last one seen raises Released, so a die waiting for a lost peer leaves its wait, returns to its
event loop and answers heartbeats again. No vote follows a release: the lost die would never
join it.

Cost (docs/mpi.md idioms): interrupt() is Win.Sync + one load when every die shares this
node, else Fetch_and_op(NO_OP) + Flush on oneself, which also reaches writers on other nodes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from mpi4py import MPI

from xccl.errors import (
    InjectedFault,
    PeerTimeout,
    RetriesExhausted,
    RollbackRequested,
    XcclError,
    XcclTimeout,
)
from xccl.gmem import DieMemory
from xccl.recovery.faults import Realignable
from xccl.recovery.vote import HEADER, Fault, FaultReport, Outcome, decode, encode

__all__ = ["FaultReport", "Outcome", "Recovery", "Released", "fence", "fence_window"]

T = TypeVar("T")
ROLLBACK_WORD, FENCE_WORD = 0, 8  # byte offsets in each die's window


class Released(XcclError):
    """Raised inside a wait (or the dies' agreement) when the TE-shell fenced the dies after a
    silent one: leave the iteration and answer from the event loop (ranks/recovery/detector.py)."""

    def __init__(self, die: int, fence: int) -> None:
        super().__init__(f"die rank {die}: released by the TE-shell's fence {fence}")
        self.die, self.fence = die, fence

    def __reduce__(self):
        return type(self), (self.die, self.fence)


class Recovery:
    """The abort signal and the vote over the dies' communicator (collective constructor)."""

    def __init__(
        self,
        comm: MPI.Comm,
        *,
        timeout_s: float,
        max_states: int = 16,
        window_comm: MPI.Comm | None = None,
        recover_timeouts: bool = False,
        vote_timeout_s: float | None = None,
    ) -> None:
        """window_comm: the communicator the abort words' window spans (default: comm, the dies);
        the world one when a TE-shell fences the dies (it joins with `fence_window`).
        recover_timeouts: a wait that timed out (PeerTimeout) fails the attempt like an injected
        fault, instead of ending the run. vote_timeout_s: how long a vote waits for every die
        (default timeout_s); a fence ends the wait earlier (Released)."""
        window_comm = comm if window_comm is None else window_comm
        self.mem = DieMemory(window_comm, 16, wakes=False)  # polled by interrupt(), never slept on
        self.window_comm, self.me = window_comm, window_comm.rank
        # A writer on another node needs the RMA idiom; one node: a local load sees every write.
        self.is_one_node = all(self.mem.is_same_node)
        self.fence_seen = 0
        self.timeout_s, self.max_states = timeout_s, max_states
        self.recover_timeouts = recover_timeouts
        self.vote_timeout_s = timeout_s if vote_timeout_s is None else vote_timeout_s
        self.epoch = 0
        self.timed_out_at = -1.0  # time.time() of this die's last recovered timeout
        self._notified = False
        self._waiting: tuple[int, int, float] | None = None  # RollbackRequested.waiting
        self._join(comm)

    def _join(self, comm: MPI.Comm) -> None:
        """Vote over `comm` (the dies); notify each die's word in the window."""
        # Each die's rank in the window (the dies' ranks in the world, with a TE-shell).
        self.peers = comm.group.Translate_ranks(list(range(comm.size)), self.window_comm.group)
        self.comm, self.rank, self.num_dies = comm, comm.rank, comm.size
        self._send = np.zeros(HEADER + self.max_states, np.int64)
        self._recv = np.zeros((comm.size, HEADER + self.max_states), np.int64)

    def regroup(self, comm: MPI.Comm) -> None:
        """After vertical scaling (ranks/recovery/scale_down.py): vote over the survivors' `comm`
        (collective over them). A fence may have cut a vote short on some dies and not on
        others, and left notifies in the words: every survivor takes the highest epoch and
        word any of them holds, so no stale word reads as a rollback of the next attempt."""
        self._join(comm)
        mine = max(self.epoch, self._words()[0])
        self.epoch = comm.allreduce(mine, op=MPI.MAX)
        self._notified = False

    def interrupt(self) -> None:
        """Raise Released if the TE-shell fenced the dies, RollbackRequested if another die
        signalled that this attempt failed."""
        word, fence = self._words()
        self._check_fence(fence)
        if word > self.epoch:
            raise RollbackRequested(self.rank, self.epoch)

    def check_fence(self) -> None:
        """Raise Released if the TE-shell fenced the dies (outside an attempt, e.g. while the
        dies agree between iterations, where a rollback word belongs to the next attempt)."""
        self._check_fence(self._words()[1])

    def _words(self) -> tuple[int, int]:
        """(rollback word, fence word) of this die's window."""
        if self.is_one_node:
            self.mem.sync()
            return int(self.mem.words[0]), int(self.mem.words[1])
        return self.mem.fetch_word(self.me, ROLLBACK_WORD), self.mem.fetch_word(self.me, FENCE_WORD)

    def _check_fence(self, fence: int) -> None:
        if fence > self.fence_seen:
            self.fence_seen = fence
            raise Released(self.rank, fence)

    def notify(self) -> None:
        """Tell every die that this attempt failed: epoch + 1 into every die's word, flushed."""
        for peer in self.peers:
            self.mem.store_word(peer, ROLLBACK_WORD, self.epoch + 1)
            self.mem.flush(peer)  # the word buffer is reused by the next store
        self._notified = True

    def vote(self, fault: Fault | None, states: Sequence[int]) -> Outcome:
        """Every die, once per attempt: did any die fail it? One allgather, bounded by
        vote_timeout_s.

        fault: this die's InjectedFault (or PeerTimeout), or None. states: this die's
        publication states (the same layout on every die: the same buffers in the same order;
        missing trailing ones count as 0), at most max_states non-negative ints."""
        if len(states) > self.max_states:
            raise ValueError(
                f"die rank {self.rank}: {len(states)} publication states to vote, "
                f"max_states is {self.max_states}"
            )
        encode(
            self._send,
            notified=self._notified,
            fault=fault,
            states=states,
            waiting=self._waiting,
            timed_out_at=self.timed_out_at,
        )
        self._waiting = None
        self._allgather()
        outcome = decode(self._recv[:, : HEADER + len(states)].tolist(), self.epoch)
        self.epoch = outcome.epoch
        self._notified = False
        return outcome

    def run(
        self,
        attempt: Callable[[int], T],
        buffers: Sequence[Realignable],
        *,
        max_retries: int,
        what: str,
        on_rollback: Callable[[Outcome], None] | None = None,
    ) -> T:
        """attempt(k) for k = 0, 1, ... until one succeeds on every die (steps 1-4 above).

        buffers: this die's XCCL buffers, in the same order on every die. on_rollback(outcome):
        after the buffers resynced, restore the caller's state. After max_retries re-executions
        a further failure raises RetriesExhausted on every die, naming `what` and the faults."""
        if max_retries < 0:
            raise ValueError(f"die rank {self.rank}: max_retries must be >= 0, got {max_retries}")
        for k in range(max_retries + 1):
            try:
                fault, result = None, attempt(k)
            except self.failures as exc:
                fault, result = self.failed(exc, buffers), None
            outcome = self.settle(fault, buffers)
            if not outcome.failed:
                return result
            if on_rollback is not None:
                on_rollback(outcome)
        raise RetriesExhausted(
            f"die rank {self.rank}: {what} failed {max_retries + 1} attempts "
            f"(max_retries {max_retries}); the last: " + "; ".join(str(f) for f in outcome.faults)
        )

    @property
    def failures(self) -> tuple[type[XcclError], ...]:
        """What fails an attempt instead of ending the run: an injected fault, another die's
        rollback signal, and with recover_timeouts a wait that timed out."""
        if self.recover_timeouts:
            return (InjectedFault, PeerTimeout, RollbackRequested)
        return (InjectedFault, RollbackRequested)

    def failed(self, exc: XcclError, buffers: Sequence[Realignable]) -> Fault | None:
        """Steps 1-2 of an attempt that raised `exc` (one of `failures`): the other dies told
        (unless `exc` is their signal), this die's RMA abandoned; its fault for the vote (None:
        another die's)."""
        if isinstance(exc, RollbackRequested):
            self._waiting = exc.waiting  # voted: whom this die was waiting for
            _abandon(buffers)
            return None
        if isinstance(exc, PeerTimeout):
            self.timed_out_at = time.time()  # a late peer: like a fault
        self.notify()
        _abandon(buffers)
        return exc

    def settle(self, fault: Fault | None, buffers: Sequence[Realignable]) -> Outcome:
        """Steps 3-4 of an attempt, on every die once it completed or failed: the vote, and
        after a failed one every buffer resynced to the dies' max (the caller restores its own
        state and attempts again)."""
        outcome = self.vote(fault, [v for b in buffers for v in b.publication_state()])
        if outcome.failed:
            at = 0
            for b in buffers:
                n = len(b.publication_state())
                b.resync(outcome.states[at : at + n])
                at += n
        return outcome

    def free(self) -> None:
        """Release the window; safe to call twice."""
        self.mem.free()

    def _allgather(self) -> None:
        request = self.comm.Iallgather(self._send, self._recv)
        deadline = time.monotonic() + self.vote_timeout_s
        while not request.Test():
            if self.window_comm is not self.comm:  # a TE-shell fences: a lost die never votes
                self.check_fence()
            if time.monotonic() > deadline:
                raise XcclTimeout(
                    f"die rank {self.rank}: vote of epoch {self.epoch}: not every "
                    f"die voted after {self.vote_timeout_s:g} s (a die stuck outside "
                    "XCCL's waits, or one whose waits have no interrupt)"
                )
            os.sched_yield()


def fence_window(comm: MPI.Comm) -> DieMemory:
    """The TE-shell's side of the dies' abort-word window over the world `comm` (collective with
    the dies' Recovery(window_comm=comm)); it holds no words."""
    return DieMemory(comm, 0, wakes=False)  # as the dies' Recovery window


def fence(mem: DieMemory, dies: Sequence[int], value: int) -> None:
    """The TE-shell's release: `value` (growing with each fence) into every die's fence word."""
    for die in dies:
        mem.store_word(die, FENCE_WORD, value)
        mem.flush(die)


def _abandon(buffers: Sequence[Realignable]) -> None:
    for b in buffers:
        b.abandon()
