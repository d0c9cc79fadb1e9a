"""A decode die's side of failure detection (xDeepServe §6.1; colocated dies, and afd attention
and expert dies through ranks/afd_health.py): it answers the TE-shell's heartbeats from its event
loop only, plays the `stuck` and `dead` rows of `faults.events` that name it, and once the
TE-shell's fence released it (xccl/recovery.py Released), idles answering until the run ends.

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

from ranks.heartbeat import HeartbeatResponder
from xds_mpi.config import Config
from xds_mpi.tags import TAG_FAILURE_BEGAN, TAG_STOP

SHELL = 0
# Where a stuck die blocks: a colocated die's dispatch; an afd die's A2E (the attention die's
# tokens, or a trampoline's / expert die's forwarded rows).
STUCK_OPS = ("dispatch", "a2e")


def is_watched(cfg: Config, plan) -> bool:
    """Does the TE-shell watch the dies with heartbeats and fence them? Colocated and afd
    deployments without PD (the PD decode side is refused in xds_mpi/failure_plan.py EMULATED)."""
    kind = cfg.deployment.kind
    return cfg.health.enabled and plan.pd is None and kind in ("colocated", "afd")


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
    ) -> None:
        self.comm, self.rank = comm, comm.rank
        self.iteration, self.virtual_s = iteration, virtual_s
        self.responder = HeartbeatResponder(comm, SHELL)
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
        # Blocked: no loop, no answers. The job's end (the TE-shell's stop) unblocks it, so
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
        self.pending.append(self.comm.isend(note, dest=SHELL, tag=TAG_FAILURE_BEGAN))
