"""The TE-shell's decisions on the virtual clock (docs/virtual_time.md): pure rules, no MPI.

A request arriving at virtual time a is decided (a DP group picked, xDeepServe §4.3) at
t = max(a, the previous decision): FIFO, as the wall-clock TE-shell takes its queue. The
balancer sees the state at t: a request whose last token was sampled at or before t has
completed, one finishing later still holds its batch slot and KV reservation. When every group
is full at t, the request is decided at the first completion after t that frees one. The shell
decides only up to `now_s`, the virtual time up to which every die has reported what it did
(`decide`); the horizon it then grants is the first virtual time at which it may hand a die
work again. A die runs an iteration only when its virtual start is before that horizon
(`may_start`), so no request ever reaches a die whose clock has passed its arrival.

Virtual times travel in the dies' one-sided agreement as the bits of a float64 (`to_word`,
`from_words`): non-negative floats order as their bit patterns, so no rounding enters the
protocol and a run's virtual times do not depend on this machine.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from xds_mpi.scheduling.balancer import DecodeBalancer
from xds_mpi.workload.requests import Request

INF = math.inf


@dataclass(frozen=True, kw_only=True)
class Decision:
    """`req` goes to DP group `group`, decided at virtual time `vtime_s` (seconds)."""

    req: Request
    group: int
    vtime_s: float


@dataclass(frozen=True, kw_only=True)
class NextGrant:
    """What the TE-shell hands the dies after deciding: the decisions, the horizon (dies run
    iterations that start before it; inf: no request left to decide) and the warp (every idle
    die's clock jumps to it; -inf: none)."""

    decisions: tuple[Decision, ...]
    horizon_s: float
    warp_s: float


class Completions:
    """Requests finished on the dies, applied to the balancer in virtual-time order: a finish
    reported at virtual time f frees its slot for a decision at t only once t >= f."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []  # (finish virtual s, req_id)

    def add(self, req_id: int, finish_s: float) -> None:
        heapq.heappush(self._heap, (finish_s, req_id))

    def next_s(self) -> float:
        """The earliest finish not applied yet (inf: none)."""
        return self._heap[0][0] if self._heap else INF

    def apply_until(self, t_s: float, balancer: DecodeBalancer) -> None:
        while self._heap and self._heap[0][0] <= t_s:
            balancer.on_complete(heapq.heappop(self._heap)[1])

    def __len__(self) -> int:
        return len(self._heap)


def decide(
    queue: deque[Request],
    balancer: DecodeBalancer,
    completions: Completions,
    *,
    now_s: float | None,
    after_s: float,
    idle_s: float = 0.0,
    arrival_of=lambda req: req.arrival_s,
) -> NextGrant:
    """Decide the queued requests (popped from `queue`, in order) whose decision time is at or
    before `now_s`: every die has reported its iterations up to it. after_s: the previous
    decision's virtual time (decisions never go back). now_s None: every die is idle at
    virtual `idle_s` and every finish is known, so nothing happens before the queue's head is
    decided: time warps to it (or stays at idle_s when the head arrived while the last
    iterations ran; it is still decided at its arrival, from the state then). arrival_of: an
    item's arrival (the decode TE-shell of PD queues tasks, arriving when their prefill ends)."""
    if now_s is None:
        if not queue:
            return NextGrant(decisions=(), horizon_s=INF, warp_s=-INF)
        now_s = warp_s = max(arrival_of(queue[0]), after_s, idle_s)
    else:
        warp_s = -INF
    decisions: list[Decision] = []
    while queue:
        t_s = max(arrival_of(queue[0]), after_s)
        if t_s > now_s:
            break
        completions.apply_until(t_s, balancer)
        group = balancer.pick(queue[0])
        while group is None and completions.next_s() <= now_s:
            t_s = completions.next_s()  # the head waits for the first slot freed after t
            completions.apply_until(t_s, balancer)
            group = balancer.pick(queue[0])
        if group is None:  # blocked: a slot may free at the end of the dies' next iteration
            return NextGrant(
                decisions=tuple(decisions), horizon_s=math.nextafter(now_s, INF), warp_s=warp_s
            )
        req = queue.popleft()
        balancer.on_dispatch(group, req)
        decisions.append(Decision(req=req, group=group, vtime_s=t_s))
        after_s = t_s
    horizon_s = max(arrival_of(queue[0]), after_s) if queue else INF
    return NextGrant(decisions=tuple(decisions), horizon_s=horizon_s, warp_s=warp_s)


def may_start(start_s: float, horizon_s: float) -> bool:
    """May the dies run an iteration starting at virtual `start_s` under `horizon_s`? Only
    before it: a request arriving at the horizon joins the first iteration starting at or
    after its arrival, and the TE-shell has not decided it yet."""
    return start_s < horizon_s


def to_word(seconds: float) -> int:
    """A non-negative virtual time (inf allowed) as an agreement word: its float64 bits."""
    if not seconds >= 0.0:
        raise ValueError(f"a virtual time in the agreement must be >= 0, got {seconds}")
    return int(np.float64(seconds).view(np.int64))


def from_words(words: np.ndarray) -> np.ndarray:
    """`to_word`'s inverse over an array of agreement words: float64 seconds."""
    return np.ascontiguousarray(words, dtype=np.int64).view(np.float64)
