"""The event loop every watched decode die shares: a colocated die (ranks/colocated/die.py) and
an afd attention or expert die (ranks/afd/common.py). A turn answers the TE-shell's heartbeats
(§6.1) and runs one iteration; a die the TE-shell's fence released, or a dead one, turns out of
the iterations until it is told to rebuild without the lost dies (ranks/recovery/scale_down.py)
or to stop. What differs between the dies (their iteration, their XCCL buffer, how they
rebuild) each die says itself."""

from __future__ import annotations

from collections.abc import Callable

from mpi4py import MPI

from ranks.core.messages import SHELL, TAG_STOP
from ranks.recovery.scale_down import Failover, take_failover
from ranks.recovery.watch import DieHealth
from xccl.recovery.rollback import Released


class DecodeDieLoop:
    """Attributes a die sets: world (the world communicator), dies (the dies' communicator),
    mem (its first window), health (DieHealth, None when unwatched), recompute (Recomputer),
    is_scaled (rebuilt without lost dies), is_lost (lost itself: it leaves without a
    collective)."""

    world: MPI.Comm
    dies: MPI.Comm
    health: DieHealth | None
    is_scaled: bool = False
    is_lost: bool = False

    def iterate(self) -> bool:
        """One iteration, or an idle turn; False once every die was told to stop."""
        raise NotImplementedError

    def rebuild(self, failover: Failover) -> None:
        """Go on without `failover.lost` (ranks/recovery/scale_down.py, die steps 1-4)."""
        raise NotImplementedError

    def xccl_buffer(self):
        """The die's XCCL buffer now (EpBuffer or AfdBuffer)."""
        raise NotImplementedError

    def drain(self) -> None:
        """Complete the die's own sends to the TE-shell (tokens); none by default."""

    def step(self) -> bool:
        """One turn of the event loop: heartbeats answered here only (§6.1), then an iteration.
        A die released by the TE-shell's fence, or a dead one, only turns out of the iterations
        from then on."""
        health = self.health
        if health is None:
            return self.iterate()
        health.check_dead()
        if health.is_out:
            return self.out_turn()
        health.answer()
        try:
            return self.iterate()
        except Released:
            health.released()
            return True

    def out_turn(self) -> bool:
        """A turn out of the iterations: a released survivor rebuilds once told which dies are
        lost; a lost die idles until the TE-shell's stop (then `leave`)."""
        health = self.health
        failover = None if health.is_dead else take_failover(self.world, health.shell)
        if failover is not None:
            self.rebuild(failover)
            health.rejoined()
            return True
        if self.world.iprobe(source=SHELL, tag=TAG_STOP):
            self.world.recv(source=SHELL, tag=TAG_STOP)
            self.is_lost = True
            return False
        health.idle()
        return True

    def agreement_fence(self) -> tuple[Callable[[], None] | None, float | None]:
        """(the fence check, the timeout) the agreement between iterations waits with: a lost
        die never writes its part, so the TE-shell's fence releases the others; the wait lasts
        as long as a vote (faults.on_timeout recompute: past detection and release). Checks the
        fence once now, so that even a die that never waits sees it."""
        if self.health is None:
            return None, None
        recovery = self.recompute.recovery
        recovery.check_fence()
        return recovery.check_fence, recovery.vote_timeout_s

    def leave(self) -> None:
        """A lost die at the job's end: its own sends completed, what the TE-shell sent it
        meanwhile (requests, pings) taken, no collective."""
        self.drain()
        self.health.close()
        while (message := self.world.improbe(source=SHELL, tag=MPI.ANY_TAG)) is not None:
            message.recv()

    def close(self) -> None:
        """The collective end, on the way out together."""
        self.drain()
        if self.health is not None:
            self.health.close()
        if self.is_scaled:  # the old windows span lost dies: their frees would never return
            self.xccl_buffer().mem.free()
            self.dies.Free()
            return
        self.recompute.free()
        self.mem.free()
        self.dies.Free()
