"""Heartbeats (xDeepServe §6.1), both ends: a sender on a host rank pings its targets every
interval and knows when each last answered (`HeartbeatSender`); a responder answers from its
owner's event loop only (`HeartbeatResponder`), so an owner stuck in an executor or an XCCL wait
stops answering — which is the signal. Two tiers use the same pair with decoupled intervals: the
control plane -> each TE-shell, and a TE-shell -> the master of each DP group. A ping carries a
sequence number; the answer echoes it with a small status object of the responder's choosing.
Nothing here blocks: sends are `isend`s completed later, receives are probes.

At most one ping per target and one answer per responder are in flight: a target that has not
taken its last ping gets no new one, and a responder answers the newest of the pings it found
in a turn, once. Pinging every interval whatever was taken piled up ~3000 undelivered pings at
43 ranks on 2 cores (the dies answer once per iteration, an iteration took 1.3 s, the interval
is 0.2 s); the TE-shell's stop waited behind them for 4-5 s, and its close waited for them.

A decode die's side (`DieHealth`: colocated dies, afd attention and expert dies, through the
decode-die loop of ranks/core/decode_die.py): it answers the TE-shell's heartbeats from its
event loop only, and once the TE-shell's fence released it (xccl/recovery/rollback.py
Released), idles answering until it is told to rebuild (ranks/recovery/scale_down.py) or the run
ends. The `stuck` and `dead` rows are played by ranks/faults/ (which this package never
imports): a dead die falls silent here (`fall_silent`), and an injected fault's note to the
TE-shell (when it began, TAG_FAILURE_BEGAN, for the failure record only: detection never reads
it) goes out with the die's answers (`tell`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from mpi4py import MPI

from ranks.core.control import WaitTimeout, wait_all
from ranks.core.messages import SHELL, FaultBegan
from ranks.core.tags import (
    TAG_FAILOVER,
    TAG_FAILURE_BEGAN,
    TAG_HEARTBEAT,
    TAG_HEARTBEAT_ACK,
)
from xds_mpi.config.schema import Config


@dataclass(frozen=True, kw_only=True)
class Ping:
    seq: int
    sent_at: float  # sender's time.monotonic()


@dataclass(frozen=True, kw_only=True)
class Pong:
    seq: int
    status: object = None


# A responder's last answer (`HeartbeatResponder.close(last=True)`): nothing follows it, and it
# comes after every answer before it (one sender, one tag), so a sender that takes it from each
# target leaves none of their answers unreceived, with or without a collective after it.
LAST_SEQ = -1


# A target is silent once it has not answered for PACE_FACTOR x the longest gap seen between two
# answers of any target, when that is longer than timeout_s. An emulated die runs far slower than
# a 910C (ep288 puts 289 ranks on the cores of one workstation: an iteration takes seconds), and
# a die answers only between iterations: a fixed wall-clock timeout shorter than an iteration
# fenced healthy dies. The pace is what the targets show they need; gaps across a fence (the
# waits it released) are not counted. Until some target has answered, no pace is known (ep288's
# first iteration took 54 s on 2 cores): the patience is then the ceiling, the longest the
# detector can wait and still fence before the peers' own XCCL waits time out, so that a die
# lost before any die answered (dead at the first iteration: its peers wait for it in the
# agreement and never take a turn) is still found and the run goes on without it.
PACE_FACTOR = 3.0


class HeartbeatSender:
    """Pings `targets` every `interval_s`; `silent()` names those with no answer for
    `patience_s` (counted from the later of the first ping and their last answer):
    timeout_s, or PACE_FACTOR x `pace_s` when the targets answer slower than that, up to
    ceiling_s (the detector's: before the peers' own XCCL waits time out); ceiling_s itself
    until some target has answered (none is silent then when it is infinite)."""

    def __init__(
        self,
        comm: MPI.Comm,
        targets: Sequence[int],
        *,
        interval_s: float,
        timeout_s: float,
        ceiling_s: float = float("inf"),
    ) -> None:
        self.comm, self.targets = comm, tuple(targets)
        self.interval_s, self.timeout_s, self.ceiling_s = interval_s, timeout_s, ceiling_s
        self.seq, self.next_at = 0, 0.0
        self.started_at: float | None = None
        self.last_answer: dict[int, float] = {}
        self.status: dict[int, object] = {}
        self.in_flight: dict[int, MPI.Request] = {}  # target -> its last ping, until complete
        self.pace_s = 0.0  # the longest gap seen between two answers of a target
        self.counted_from: float | None = None  # gaps that began before this are not counted

    def tick(self, now: float | None = None) -> None:
        """Send the pings that are due and take every answer that arrived."""
        now = time.monotonic() if now is None else now
        if self.started_at is None:
            self.started_at = now
        if now >= self.next_at:
            self.seq += 1
            self.next_at = now + self.interval_s
            self.in_flight = {t: r for t, r in self.in_flight.items() if not r.Test()}
            ping = Ping(seq=self.seq, sent_at=now)
            for target in self.targets:
                if target not in self.in_flight:  # its last ping not taken: no second one
                    self.in_flight[target] = self.comm.isend(ping, dest=target, tag=TAG_HEARTBEAT)
        # One probe for any answer, not one per target: the TE-shell ticks every turn of its
        # loop, and 288 probes a turn took most of a core at ep288.
        status = MPI.Status()
        while (
            msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_HEARTBEAT_ACK, status=status)
        ) is not None:
            pong: Pong = msg.recv()
            target = status.Get_source()
            if target in self.targets:  # not one forgotten meanwhile
                self._count_gap(target, now)
                self.last_answer[target], self.status[target] = now, pong.status

    @property
    def has_pace(self) -> bool:
        """Has some target answered (so that the pace, not the ceiling, sets the patience)?"""
        return bool(self.last_answer)

    @property
    def patience_s(self) -> float:
        """How long a target may stay silent before `silent` names it."""
        if not self.has_pace:  # the targets may all be in their first iteration still
            return max(self.timeout_s, self.ceiling_s)
        return max(self.timeout_s, min(PACE_FACTOR * self.pace_s, self.ceiling_s))

    def silent(self, now: float | None = None) -> list[int]:
        """Targets that have not answered for longer than `patience_s`."""
        now = time.monotonic() if now is None else now
        # Silent: the last answer (or the first ping, if later) before `heard_by`. The TE-shell
        # asks every turn of its loop; with patience and the first ping checked once, a turn
        # costs a dict lookup per target (docs/scale.md).
        heard_by = now - self.patience_s
        if self.started_at is None or self.started_at >= heard_by:
            return []
        last, first = self.last_answer, self.started_at
        return [t for t in self.targets if last.get(t, first) < heard_by]

    def silence_s(self, target: int, now: float | None = None) -> float:
        """How long `target` has not answered (counted from the first ping at most)."""
        return (time.monotonic() if now is None else now) - self._since(target)

    def count_silence(self, silence_s: float) -> None:
        """A fence that found every target alive: the silence it ended was their pace (an
        iteration no answer had shown yet, the first one's above all), not a fault."""
        self.pace_s = max(self.pace_s, silence_s)

    def restart_pace(self, now: float | None = None) -> None:
        """After a fence: the silence it ended was a fault's, not the targets' pace."""
        self.counted_from = time.monotonic() if now is None else now

    def _since(self, target: int) -> float:
        return max(self.last_answer.get(target, self.started_at), self.started_at)

    def _count_gap(self, target: int, now: float) -> None:
        began = self._since(target)
        if self.counted_from is None or began >= self.counted_from:
            self.pace_s = max(self.pace_s, now - began)

    def close(self, *, timeout_s: float, last_from: Sequence[int] = ()) -> None:
        """After the responders stopped answering (the caller's last collective), or with
        `last_from`, until each of those targets' last answer came (they close after the caller,
        with no collective between: a PD decode TE-shell's dies, a failover's survivors): take
        the answers still queued and complete the pings within `timeout_s`, so nothing is left
        pending at finalize."""
        me = f"rank {self.comm.rank}"
        deadline = time.monotonic() + timeout_s
        waiting, status = set(last_from), MPI.Status()
        while True:  # one probe for any answer, as in `tick` (lost targets' answers too)
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_HEARTBEAT_ACK, status=status)
            if msg is not None:
                if msg.recv().seq == LAST_SEQ:
                    waiting.discard(status.Get_source())
            elif not waiting:
                break
            elif time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{me}: no last heartbeat answer from die rank(s) {sorted(waiting)} after "
                    f"{timeout_s:g} s (the end of the run)"
                )
            else:
                time.sleep(0.0005)
        targets, pings = list(self.in_flight), list(self.in_flight.values())
        wait_all(pings, timeout_s=timeout_s, me=me, event="heartbeat pings", peers=targets)
        self.in_flight = {}

    def forget(self, target: int) -> None:
        """Stop pinging a target the caller has declared lost."""
        self.targets = tuple(t for t in self.targets if t != target)


class HeartbeatResponder:
    """Answers pings from `source`; call `answer()` once per turn of the owner's event loop: the
    newest ping found, once, unless the last answer is still in flight (it shows life too)."""

    def __init__(self, comm: MPI.Comm, source: int) -> None:
        self.comm, self.source = comm, source
        self.pending: list[MPI.Request] = []
        self.unanswered: Ping | None = None  # the newest ping taken and not answered yet
        self.answered = 0

    def answer(self, status: object = None) -> None:
        while (msg := self.comm.improbe(source=self.source, tag=TAG_HEARTBEAT)) is not None:
            self.unanswered = msg.recv()
        self.pending = [r for r in self.pending if not r.Test()]
        if self.unanswered is not None and not self.pending:
            pong = Pong(seq=self.unanswered.seq, status=status)
            self.pending.append(self.comm.isend(pong, dest=self.source, tag=TAG_HEARTBEAT_ACK))
            self.unanswered = None
            self.answered += 1

    def close(self, *, timeout_s: float, last: bool = False) -> None:
        """Take the pings still queued unanswered and complete the answers sent within
        `timeout_s` (call before the owner's last collective, so the sender's `close` after it
        finds every answer); `last`: end with the last answer (LAST_SEQ), which the sender's
        `close(last_from=...)` waits for."""
        while (msg := self.comm.improbe(source=self.source, tag=TAG_HEARTBEAT)) is not None:
            msg.recv()
        if last:
            pong = Pong(seq=LAST_SEQ)
            self.pending.append(self.comm.isend(pong, dest=self.source, tag=TAG_HEARTBEAT_ACK))
        wait_all(
            self.pending,
            timeout_s=timeout_s,
            me=f"rank {self.comm.rank}",
            event=f"heartbeat answers to rank {self.source}",
        )
        self.pending = []


def is_watched(cfg: Config, plan) -> bool:
    """Does a TE-shell watch the decode dies with heartbeats and fence them? Colocated and afd
    deployments without PD; in PD the decode TE-shell (host rank 1) watches the decode dies
    (colocated, or afd attention and expert dies) when a stuck/dead row names one
    (ranks/recovery/decode_loss.py; xds_mpi/plan/failures/checks.py refuses the rest)."""
    kind = cfg.deployment.kind
    if plan.pd is not None:
        return cfg.health.enabled and kind in ("colocated", "afd") and has_decode_loss(cfg, plan)
    return cfg.health.enabled and kind in ("colocated", "afd")


def has_decode_loss(cfg: Config, plan) -> bool:
    """PD: does a stuck/dead row name a decode die (with a decode TE-shell to watch it)?"""
    decode = set(watched_dies(plan))
    rows = [e for e in cfg.faults.events if e.kind in ("stuck", "dead") and e.die in decode]
    return bool(rows) and plan.pd.decode_shell != 0


def watcher(plan) -> int:
    """The rank that pings, fences and fails over the decode dies: the TE-shell, or in PD the
    decode TE-shell."""
    return plan.pd.decode_shell if plan.pd is not None else SHELL


def watched_dies(plan) -> tuple[int, ...]:
    """PD: the decode dies the decode TE-shell watches: the DP masters (colocated or attention
    dies) and an afd decode side's expert dies."""
    return (*plan.pd.decode, *plan.topo.ranks_with_role("expert"))


def watch_comm(ctx) -> MPI.Comm:
    """The communicator the fence window spans: the world, or in PD the decode TE-shell and the
    decode dies only (Create_group: collective over them alone, the JE and prefill dies never
    join), or with an EMS pool the TE-shell and the colocated dies (the pool ranks never join).
    Called once by the watcher and every decode die, in the same order."""
    plan = ctx.plan
    if plan.pd is not None:
        members = [plan.pd.decode_shell, *watched_dies(plan)]
    elif plan.ems is not None:
        members = [SHELL, *plan.ems.clients]
    else:
        return ctx.comm
    return ctx.comm.Create_group(ctx.comm.group.Incl(members))


class DieHealth:
    """A die's side of the heartbeats: rank, the die's world rank; shell, the watcher's rank
    (`watcher`). The hook the decode-die loop calls (ranks/core/decode_die.py DieWatch),
    installed as the die's `health` when it is built."""

    def __init__(self, cfg: Config, comm: MPI.Comm, *, shell: int = SHELL) -> None:
        self.comm, self.rank, self.shell = comm, comm.rank, shell
        self.responder = HeartbeatResponder(comm, shell)
        self.is_dead = self.is_released = False
        self.pending: list[MPI.Request] = []
        self.close_timeout_s = cfg.xccl.poll_timeout_s  # the bound of every wait on the way out

    @property
    def is_out(self) -> bool:
        """Dead, or released by the fence: the die runs no iteration any more."""
        return self.is_dead or self.is_released

    def answer(self) -> None:
        """From the event loop, between iterations: answer the heartbeats that arrived."""
        if not self.is_dead:
            self.responder.answer()

    def fall_silent(self) -> None:
        """A dead row took effect (ranks/faults/dead.py): from now on the die answers nothing."""
        self.is_dead = True

    def tell(self, note: FaultBegan) -> None:
        """An injected fault's note to the watcher (ranks/faults/), completed by `close`."""
        self.pending.append(self.comm.isend(note, dest=self.shell, tag=TAG_FAILURE_BEGAN))

    def released(self) -> None:
        """The fence released this die from a wait or the agreement: out of the iterations."""
        self.is_released = True

    def take_failover(self):
        """The watcher's Failover (ranks/recovery/scale_down.py), if it arrived."""
        message = self.comm.improbe(source=self.shell, tag=TAG_FAILOVER)
        return None if message is None else message.recv()

    def rejoined(self) -> None:
        """The die rebuilt without the lost dies (ranks/recovery/scale_down.py): it runs
        iterations again."""
        self.is_released = False

    def idle(self) -> None:
        """A turn of a die that is out: a released die still answers, a dead one does not."""
        self.answer()
        self.pending = [r for r in self.pending if not r.Test()]
        time.sleep(0.002)

    def close(self, *, last: bool = True) -> None:
        """Before the dies' last collective with the TE-shell: the fault notes, then the
        answers, the last one too (`last`; a lost die leaving sends none: the watcher forgot
        it)."""
        timeout_s = self.close_timeout_s
        event = f"fault notes to rank {self.shell}"
        wait_all(self.pending, timeout_s=timeout_s, me=f"die rank {self.rank}", event=event)
        self.pending = []
        self.responder.close(timeout_s=timeout_s, last=last)
