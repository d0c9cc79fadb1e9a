"""A decode die's side of failure detection (xDeepServe §6.1; colocated dies, and afd attention
and expert dies through ranks/recovery/afd_health.py): it answers the TE-shell's heartbeats from its
event
loop only, plays the `stuck` and `dead` rows of `faults.events` that name it, and once the
TE-shell's fence released it (xccl/recovery/rollback.py Released), idles answering until the run
ends.

Faults as emulated (docs/design.md, Failures):
  stuck  the die blocks inside its first dispatch (afd: A2E) of iteration `iteration` or later
         (staged, not yet published: every peer waits for it) for duration_s wall seconds, 0 =
         for good; the process is alive and answers nothing meanwhile.
  dead   at iteration `iteration` the die stops taking part: it joins no collective and no
         XCCL operation and answers no heartbeat, an idle live process until the job ends.
The die tells the TE-shell when its fault began (TAG_FAILURE_BEGAN), for the failure record
only: detection never reads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mpi4py import MPI

from ranks.recovery.heartbeat import HeartbeatResponder
from xds_mpi.config.schema import Config
from xds_mpi.tags import TAG_FAILURE_BEGAN, TAG_STOP

SHELL = 0
# Where a stuck die blocks: a colocated die's dispatch; an afd die's A2E (the attention die's
# tokens, or a trampoline's / expert die's forwarded rows).
STUCK_OPS = ("dispatch", "a2e")


def is_watched(cfg: Config, plan) -> bool:
    """Does a TE-shell watch the decode dies with heartbeats and fence them? Colocated and afd
    deployments without PD; in PD the decode TE-shell (host rank 1) watches colocated decode dies
    when a stuck/dead row names one (ranks/recovery/decode_loss.py; xds_mpi/plan/failures.py refuses
    the
    rest)."""
    kind = cfg.deployment.kind
    if plan.pd is not None:
        return cfg.health.enabled and kind == "colocated" and has_decode_loss(cfg, plan)
    return cfg.health.enabled and kind in ("colocated", "afd")


def has_decode_loss(cfg: Config, plan) -> bool:
    """PD: does a stuck/dead row name a decode die (with a decode TE-shell to watch it)?"""
    decode = set(plan.pd.decode)
    rows = [e for e in cfg.faults.events if e.kind in ("stuck", "dead") and e.die in decode]
    return bool(rows) and plan.pd.decode_shell != 0


def watcher(plan) -> int:
    """The rank that pings, fences and fails over the decode dies: the TE-shell, or in PD the
    decode TE-shell."""
    return plan.pd.decode_shell if plan.pd is not None else SHELL


def watch_comm(ctx) -> MPI.Comm:
    """The communicator the fence window spans: the world, or in PD the decode TE-shell and the
    decode dies only (Create_group: collective over them alone, the JE and prefill dies never
    join). Called once by the watcher and every decode die, in the same order."""
    plan = ctx.plan
    if plan.pd is None:
        return ctx.comm
    members = [plan.pd.decode_shell, *plan.pd.decode]
    return ctx.comm.Create_group(ctx.comm.group.Incl(members))


@dataclass(frozen=True, kw_only=True)
class FaultBegan:
    """A die's note to the TE-shell: its injected `kind` fault began at its iteration
    `iteration`, at wall time `wall_time` (time.time()) and virtual second `virtual_s`."""

    die: int
    kind: str
    iteration: int
    wall_time: float
    virtual_s: float


class DieHealth:
    """rank: the die's world rank; iteration(): its iteration with work now; virtual_s(): its
    virtual clock in seconds."""

    def __init__(
        self,
        cfg: Config,
        comm: MPI.Comm,
        *,
        iteration: Callable[[], int],
        virtual_s: Callable[[], float],
        shell: int = SHELL,
    ) -> None:
        """shell: the watcher's rank (ranks/recovery/die_health.py watcher)."""
        self.comm, self.rank, self.shell = comm, comm.rank, shell
        self.iteration, self.virtual_s = iteration, virtual_s
        self.responder = HeartbeatResponder(comm, shell)
        mine = [e for e in cfg.faults.events if e.die == comm.rank]
        self.rows = {e.kind: e for e in mine if e.kind in ("stuck", "dead")}
        self.is_dead = self.is_released = self.has_stalled = False
        self.pending: list[MPI.Request] = []

    @property
    def is_out(self) -> bool:
        """Dead, or released by the fence: the die runs no iteration any more."""
        return self.is_dead or self.is_released

    def answer(self) -> None:
        """From the event loop, between iterations: answer the heartbeats that arrived."""
        if not self.is_dead:
            self.responder.answer()

    def check_dead(self) -> None:
        """At the start of a turn: a dead row of this die's iteration now takes effect."""
        row = self.rows.get("dead")
        if row is not None and not self.is_dead and self.iteration() >= row.iteration:
            self.is_dead = True
            self._began("dead")

    def stall(self, op: str, event_id: int) -> None:
        """The fault hook inside each XCCL operation: a stuck row blocks here, once."""
        row = self.rows.get("stuck")
        if row is None or self.has_stalled or op not in STUCK_OPS:
            return
        if self.iteration() < row.iteration:  # afd: an idle domain's die skips iterations
            return
        self.has_stalled = True
        self._began("stuck")
        until = time.monotonic() + row.duration_s if row.duration_s > 0 else float("inf")
        # Blocked: no loop, no answers. The job's end (the TE-shell's or JE's stop) unblocks it, so
        # that a die stuck for good still exits (the emulator's need, not the fault's).
        while time.monotonic() < until and not self.comm.iprobe(source=SHELL, tag=TAG_STOP):
            time.sleep(min(0.05, max(until - time.monotonic(), 0.0)))

    def released(self) -> None:
        """The fence released this die from a wait or the agreement: out of the iterations."""
        self.is_released = True

    def idle(self) -> None:
        """A turn of a die that is out: a released die still answers, a dead one does not."""
        self.answer()
        self.pending = [r for r in self.pending if not r.Test()]
        time.sleep(0.002)

    def close(self) -> None:
        """Before the dies' last collective with the TE-shell."""
        self.responder.close()
        MPI.Request.Waitall(self.pending)
        self.pending = []

    def _began(self, kind: str) -> None:
        note = FaultBegan(
            die=self.rank,
            kind=kind,
            iteration=self.iteration(),
            wall_time=time.time(),
            virtual_s=self.virtual_s(),
        )
        self.pending.append(self.comm.isend(note, dest=self.shell, tag=TAG_FAILURE_BEGAN))
