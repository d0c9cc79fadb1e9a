"""The expert dies' persistent loop (xDeepServe §5.2, Figure 19): receive A2E / compute / send E2A.

The paper runs three persistent kernels on three concurrent streams that busy-poll and never
return to the CPU between layers. Here one Python thread drives the same three stages as a
non-blocking state machine, over the whole list of calls of an iteration (every MoE layer, every
active DP domain, every microbatch): each turn every stage tries one step and none ever blocks, so
  stage 1 (receive)  a trampoline forwards its attention die's tokens (A2E') as soon as they land,
                     and any expert die pulls the next call's rows as soon as every sender wrote,
  stage 2 (compute)  runs the experts on the oldest received call,
  stage 3 (send)     stages outputs + records (E2A'), and a trampoline returns a call to its
                     attention die (E2A) as soon as every expert die answered,
and a die can receive call k+1 while call k still waits for a slow expert die's E2A'.
Why not threads: RMA calls from several threads need MPI_THREAD_MULTIPLE (mpi4py asks for it; an
MPI may grant less), and the GIL serializes the numpy/torch work anyway, so threads would add
locking without adding overlap; a state machine keeps every MPI call on one thread (legal at any
thread level) and shows the same data flow. Every wait is bounded: no stage progressing for
timeout_s raises an error naming the die, the call and the peers it waits for, and every turn
calls the buffer's `interrupt` (xccl/recovery/faults.py), so a rollback reaches a die in the middle
of it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from xccl.afd.buffer import AfdBuffer, AfdCall
from xccl.afd.rows import Received
from xccl.errors import PeerTimeout, RollbackRequested

# compute(call, slot, rows [n, hidden]) -> [n, hidden]: one expert slot's rows of one call.
ExpertFn = Callable[[AfdCall, int, np.ndarray], np.ndarray]


@dataclass(frozen=True, kw_only=True)
class LoopStats:
    """One run: calls served, rows computed, turns of the loop, turns where a stage overlapped
    another call (receive ahead of compute/send), wall seconds."""

    num_calls: int
    num_rows: int
    num_turns: int
    num_overlapped: int
    wall_s: float


@dataclass
class _Done:
    """How far one run got: calls past each stage, rows computed, turns, overlapped turns."""

    forwarded: int = 0
    received: int = 0
    sent: int = 0
    returned: int = 0
    num_rows: int = 0
    num_turns: int = 0
    num_overlapped: int = 0


class ExpertLoop:
    def __init__(self, buf: AfdBuffer, compute: ExpertFn, *, timeout_s: float = 60.0) -> None:
        if buf.role != "expert":
            raise ValueError(
                f"rank {buf.me} is an {buf.role} die; the expert loop runs on expert dies"
            )
        self.buf, self.compute, self.timeout_s = buf, compute, timeout_s

    def run(self, calls: Sequence[AfdCall]) -> LoopStats:
        """Serve every call in order; returns when this die's part of the last one is done."""
        buf, n, done = self.buf, len(calls), _Done()
        received: deque[Received] = deque()
        started = last_progress = time.monotonic()
        waits: dict[str, tuple] = {}  # stage -> (whom it waits for, AfdRecords.missing)
        blocked: dict[str, tuple] = {}  # stage -> (AfdRecords.missing, blocked since: time.time())
        interrupt = buf.interrupt
        while done.sent < n or (buf.is_forwarding and done.returned < n):
            if interrupt is not None:
                try:
                    interrupt()
                except RollbackRequested as exc:
                    exc.waiting = _longest_wait(buf.me, blocked)
                    raise
            turn: dict[str, tuple] = {}
            progressed = self._turn(calls, done, received, turn)
            now = time.time()
            blocked = {st: (m, blocked.get(st, (m, now))[1]) for st, (_, m) in turn.items()}
            waits.update(turn)
            done.num_turns += 1
            if progressed:
                last_progress = time.monotonic()
                waits.clear()
            elif time.monotonic() - last_progress > self.timeout_s:
                since = time.time() - (time.monotonic() - last_progress)
                raise self._timeout(done, n, waits, since)
            else:
                buf.mem.serve_far_peers()
                os.sched_yield()
        return LoopStats(
            num_calls=n,
            num_rows=done.num_rows,
            num_turns=done.num_turns,
            num_overlapped=done.num_overlapped,
            wall_s=time.monotonic() - started,
        )

    def _timeout(self, done: _Done, n: int, waits: dict[str, tuple], since: float) -> PeerTimeout:
        """No stage progressed for timeout_s: named by the first stage that misses peers (A2E
        before A2E': a trampoline's forward waits for the attention die its own A2E' waits
        for); recoverable like a record wait's timeout (xccl/records/record.py) when the caller
        recovers timeouts."""
        buf = self.buf
        missing = [m for _, m in waits.values() if m[2]] or [("expert loop", -1, ())]
        op, event_id, peers = missing[0]
        stuck = "; ".join(f"{stage}: {why}" for stage, (why, _) in waits.items())
        return PeerTimeout(
            f"die rank {buf.me}: expert loop stuck for {self.timeout_s:g} s (calls forwarded "
            f"{done.forwarded}, received {done.received}, sent {done.sent}, returned "
            f"{done.returned} of {n}): {stuck}",
            die=buf.me,
            op=op,
            event_id=event_id,
            peers=peers,
            since=since,
        )

    def _turn(
        self, calls: Sequence[AfdCall], done: _Done, received: deque, waits: dict[str, tuple]
    ) -> bool:
        """One turn: every stage tries one step, none blocks. True if any progressed."""
        buf, n, forwards = self.buf, len(calls), self.buf.is_forwarding
        progressed = False
        # Stage 1: receive A2E (a trampoline first forwards it: A2E').
        if forwards and done.forwarded < n:
            if buf.try_forward(calls[done.forwarded]):
                done.forwarded, progressed = done.forwarded + 1, True
            else:
                waits["forward"] = (buf.waiting_for, buf.records.missing)
        if done.received < n:
            if (r := buf.try_receive(calls[done.received])) is not None:
                received.append(r)
                done.received, progressed = done.received + 1, True
                # ahead of a call still pending
                done.num_overlapped += done.received - 1 > (
                    done.returned if forwards else done.sent
                )
            else:
                waits["receive"] = (buf.waiting_for, buf.records.missing)
        # Stage 2 + 3: compute the oldest received call, send its outputs (E2A').
        if received:
            r = received.popleft()
            buf.send_back(r, self._experts(r))
            done.num_rows += len(r.x)
            done.sent, progressed = done.sent + 1, True
        # Stage 3: a trampoline returns a finished call to its attention die (E2A).
        if forwards and done.returned < done.sent:
            if buf.try_return(calls[done.returned]):
                done.returned, progressed = done.returned + 1, True
            else:
                waits["return"] = (buf.waiting_for, buf.records.missing)
        return progressed

    def _experts(self, r: Received) -> np.ndarray:
        """Every local slot's rows of one call, slot by slot; outputs aligned with r.x."""
        out = np.empty_like(r.x)
        for slot in np.unique(r.slot):
            rows = np.flatnonzero(r.slot == slot)
            out[rows] = self.compute(r.call, int(slot), r.x[rows])
        return out


def _longest_wait(me: int, blocked: dict[str, tuple]) -> tuple[int, int, float] | None:
    """(me, lowest missing peer, since) of the stage blocked the longest on missing peers: what a
    rollback interrupted this die waiting for (RollbackRequested.waiting), None if nothing."""
    waiting = [(since, min(m[2])) for m, since in blocked.values() if m[2]]
    if not waiting:
        return None
    since, peer = min(waiting)
    return me, peer, since
