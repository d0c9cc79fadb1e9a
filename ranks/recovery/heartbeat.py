"""Heartbeats (xDeepServe §6.1): a sender on a host rank pings its targets every interval and
knows when each last answered; a responder answers from its owner's event loop only, so an owner
stuck in an executor or an XCCL wait stops answering — which is the signal.

Two tiers use the same pair with decoupled intervals: the control plane -> each TE-shell, and a
TE-shell -> the master of each DP group. A ping carries a sequence number; the answer echoes it
with a small status object of the responder's choosing (a TE-shell reports what its own tier
sees). Nothing here blocks: sends are `isend`s completed later, receives are probes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from mpi4py import MPI

from xds_mpi.tags import TAG_HEARTBEAT, TAG_HEARTBEAT_ACK


@dataclass(frozen=True, kw_only=True)
class Ping:
    seq: int
    sent_at: float  # sender's time.monotonic()


@dataclass(frozen=True, kw_only=True)
class Pong:
    seq: int
    status: object = None


class HeartbeatSender:
    """Pings `targets` every `interval_s`; `silent()` names those with no answer for `timeout_s`
    (counted from the later of the first ping and their last answer)."""

    def __init__(
        self, comm: MPI.Comm, targets: Sequence[int], *, interval_s: float, timeout_s: float
    ) -> None:
        self.comm, self.targets = comm, tuple(targets)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.seq, self.next_at = 0, 0.0
        self.started_at: float | None = None
        self.last_answer: dict[int, float] = {}
        self.status: dict[int, object] = {}
        self.pending: list[MPI.Request] = []

    def tick(self, now: float | None = None) -> None:
        """Send the pings that are due and take every answer that arrived."""
        now = time.monotonic() if now is None else now
        if self.started_at is None:
            self.started_at = now
        if now >= self.next_at:
            self.seq += 1
            self.next_at = now + self.interval_s
            ping = Ping(seq=self.seq, sent_at=now)
            for target in self.targets:
                self.pending.append(self.comm.isend(ping, dest=target, tag=TAG_HEARTBEAT))
        for target in self.targets:
            while (msg := self.comm.improbe(source=target, tag=TAG_HEARTBEAT_ACK)) is not None:
                pong: Pong = msg.recv()
                self.last_answer[target], self.status[target] = now, pong.status
        self.pending = [r for r in self.pending if not r.Test()]

    def silent(self, now: float | None = None) -> list[int]:
        """Targets that have not answered for longer than timeout_s."""
        now = time.monotonic() if now is None else now
        if self.started_at is None:
            return []
        return [
            t
            for t in self.targets
            if now - max(self.last_answer.get(t, self.started_at), self.started_at) > self.timeout_s
        ]

    def close(self) -> None:
        """After the responders stopped answering (the caller's last collective): take the
        answers still queued and complete the pings, so nothing is left pending at finalize."""
        for target in self.targets + tuple(self.last_answer):
            while (msg := self.comm.improbe(source=target, tag=TAG_HEARTBEAT_ACK)) is not None:
                msg.recv()
        MPI.Request.Waitall(self.pending)
        self.pending = []

    def forget(self, target: int) -> None:
        """Stop pinging a target the caller has declared lost."""
        self.targets = tuple(t for t in self.targets if t != target)


class HeartbeatResponder:
    """Answers pings from `source`; call `answer()` once per turn of the owner's event loop."""

    def __init__(self, comm: MPI.Comm, source: int) -> None:
        self.comm, self.source = comm, source
        self.pending: list[MPI.Request] = []
        self.answered = 0

    def answer(self, status: object = None) -> None:
        while (msg := self.comm.improbe(source=self.source, tag=TAG_HEARTBEAT)) is not None:
            ping: Ping = msg.recv()
            pong = Pong(seq=ping.seq, status=status)
            self.pending.append(self.comm.isend(pong, dest=self.source, tag=TAG_HEARTBEAT_ACK))
            self.answered += 1
        self.pending = [r for r in self.pending if not r.Test()]

    def close(self) -> None:
        """Take the pings still queued unanswered and complete the answers sent (call before the
        owner's last collective, so the sender's `close` after it finds every answer)."""
        while (msg := self.comm.improbe(source=self.source, tag=TAG_HEARTBEAT)) is not None:
            msg.recv()
        MPI.Request.Waitall(self.pending)
        self.pending = []
