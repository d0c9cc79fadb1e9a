"""Requests reaching the decode DP groups, as the virtual clock hands them over
(docs/planning.md, "The queue model"; docs/virtual_time.md, PD).

The rule, the emulator's own functions where they are pure (ranks/shell/pd_pacers.py
`DecodePacer` runs them on the decode TE-shell):
1. A request arrives at the decode TE-shell when its prefill ends (PD; colocated and
   `--decode-only`: at its arrival) and waits there in (arrival, req_id) order.
2. It is decided at t = max(its arrival, the previous decision) (xds_mpi/scheduling/admission.py
   `decide`): §4.3's balancer (xds_mpi/scheduling/balancer.py `DecodeBalancer`: the lowest KV
   reserved for prompt + output + drafts, then the fewest requests) picks its DP group from the
   finishes up to t; with every group at its batch limit it waits for the first finish after t.
3. Its KV lands on that group's die t + its transfer later (the pair's link, priced on its own:
   on the virtual clock transfers neither queue nor share a link).
4. It joins its group's batch at the first decode iteration starting at or after the landing.

The decode dies' barrier then makes an iteration cost what the fullest group's die spends, so
where the balancer puts each request decides the batch priced (`Batch`)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from xds_mpi.scheduling.admission import Completions, decide
from xds_mpi.scheduling.balancer import DecodeBalancer
from xds_mpi.workload.requests import Request

UNBOUNDED = 1 << 60  # the balancer's KV capacity: the replay checks no KV memory


@dataclass(frozen=True, kw_only=True)
class Balance:
    """The balancer's inputs a config sets: block_tokens (scheduler.kv_block_tokens: reservations
    round up to blocks) and mtp_depth (scheduler.mtp_depth: the drafts past the last token)."""

    block_tokens: int = 16
    mtp_depth: int = 0


class KvHandoff:
    """Steps 1-3 over one replay's requests; `serve` asks it at each iteration's start which
    requests join (`decide`, then `land`) and tells it the finishes (`finished`)."""

    def __init__(
        self,
        ready_s: np.ndarray,
        transfer_s: np.ndarray,
        prompt_len: np.ndarray,
        output_len: np.ndarray,
        *,
        req_ids: np.ndarray,
        num_groups: int,
        max_batch: int,
        balance: Balance,
    ) -> None:
        """ready_s: [n] arrival at the decode TE-shell (seconds); transfer_s: [n] its KV's move;
        req_ids: the requests that reach decode (of 0..n-1)."""
        # Step 1: the TE-shell's queue, by (arrival, req_id)
        order = req_ids[np.lexsort((req_ids, ready_s[req_ids]))]
        self.queue = deque(
            Request(
                req_id=int(i),
                prompt=range(int(prompt_len[i])),
                max_new_tokens=int(output_len[i]),
                arrival_s=float(ready_s[i]),
            )
            for i in order
        )
        self.balancer = HeapBalancer(range(num_groups), max_batch=max_batch, balance=balance)
        self.transfer_s = transfer_s
        self.completions = Completions()
        self.landing: list[tuple[float, int, int]] = []  # heap: (KV lands s, req_id, group)
        self.decided_s = 0.0
        self.is_blocked = False  # the queue's head waits for a finish

    @property
    def is_done(self) -> bool:
        return not self.queue and not self.landing

    def decide(self, now_s: float) -> None:
        """Steps 2-3 for every request decided by `now_s` (the dies' next iteration start)."""
        grant = decide(
            self.queue, self.balancer, self.completions, now_s=now_s, after_s=self.decided_s
        )
        for d in grant.decisions:
            lands = d.vtime_s + float(self.transfer_s[d.req.req_id])
            heapq.heappush(self.landing, (lands, d.req.req_id, d.group))
            self.decided_s = d.vtime_s
        self.is_blocked = bool(self.queue) and self.queue[0].arrival_s <= now_s

    def land(self, now_s: float) -> list[tuple[int, int]]:
        """Step 4: (req_id, group) of the requests whose KV has landed by `now_s`."""
        landed = []
        while self.landing and self.landing[0][0] <= now_s:
            _, req_id, group = heapq.heappop(self.landing)
            landed.append((req_id, group))
        return landed

    def finished(self, req_ids, finish_s: float) -> None:
        """Requests whose last token was sampled at `finish_s` free their slots then."""
        for req_id in req_ids:
            self.completions.add(int(req_id), finish_s)

    def next_s(self) -> float:
        """The earliest time a request may still join (inf: none, or only after a finish)."""
        lands = self.landing[0][0] if self.landing else math.inf
        if not self.queue or self.is_blocked:
            return lands
        return min(lands, max(self.queue[0].arrival_s, self.decided_s))


class HeapBalancer(DecodeBalancer):
    """`DecodeBalancer`'s picks (the open group with the least KV reserved, then the fewest
    requests, then the lowest index), found in a heap instead of a scan of every group: a pod's
    afd decode has 480 groups and a burst 46,080 requests. A group's key is pushed whenever it
    changes; entries whose key is no longer the group's are skipped, and so is a full group
    until a finish pushes it again. KV capacity is unbounded (the replay checks no KV memory),
    so only the batch limit closes a group."""

    def __init__(self, groups, *, max_batch: int, balance: Balance) -> None:
        super().__init__(
            groups,
            max_batch=max_batch,
            kv_capacity_tokens=UNBOUNDED,
            block_tokens=balance.block_tokens,
            mtp_depth=balance.mtp_depth,
        )
        self._keys = [(0, 0, g) for g in self.groups]  # heap: (reserved, pending, group)
        heapq.heapify(self._keys)

    def pick(self, req: Request) -> int | None:
        while self._keys:
            reserved, pending, group = self._keys[0]
            is_current = (reserved, pending) == (self.reserved[group], self.num_pending[group])
            if is_current and pending < self.max_batch:
                return group
            heapq.heappop(self._keys)
        return None

    def on_dispatch(self, group: int, req: Request) -> None:
        super().on_dispatch(group, req)
        self._push(group)

    def on_complete(self, req_id: int) -> int:
        group = super().on_complete(req_id)
        self._push(group)
        return group

    def _push(self, group: int) -> None:
        heapq.heappush(self._keys, (self.reserved[group], self.num_pending[group], group))


@dataclass(frozen=True, kw_only=True)
class Batch:
    """What the barrier prices of the decoding requests: fullest (requests on the fullest DP
    group), kv_len (their mean KV length; ties: the group with the longest), mean (requests per
    DP group over all of them)."""

    fullest: int
    kv_len: float
    mean: float


def batch_of(group: np.ndarray, kv: np.ndarray, num_groups: int) -> Batch:
    """group: [m] int64 DP group of each decoding request; kv: [m] their KV lengths."""
    if not len(group):
        return Batch(fullest=0, kv_len=1.0, mean=0.0)
    counts = np.bincount(group, minlength=num_groups)  # [num_groups]
    kv_sums = np.bincount(group, weights=kv, minlength=num_groups)  # [num_groups]
    fullest = int(counts.max())
    kv_len = float(kv_sums[counts == fullest].max()) / fullest
    return Batch(fullest=fullest, kv_len=kv_len, mean=len(group) / num_groups)
