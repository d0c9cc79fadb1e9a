"""The event loop every watched decode die shares: a colocated die (ranks/colocated/die.py) and
an afd attention or expert die (ranks/afd/common.py). A turn answers the TE-shell's heartbeats
(§6.1) and runs one iteration; a die the TE-shell's fence released, or a dead one, turns out of
the iterations until it is told to rebuild without the lost dies (ranks/recovery/scale_down.py)
or to stop. What differs between the dies (their iteration, their XCCL buffer, how they
rebuild) each die says itself.

The loop calls failure handling through the hooks declared here, never by importing it
(ranks/recovery/ sits above core/): `DieWatch` (ranks/recovery/watch.py DieHealth implements
it), `DieRecompute` (ranks/recovery/recompute.py Recomputer) and `Failover`
(ranks/recovery/scale_down.py Failover). The role program installs them when it builds its die
(ColocatedDie, AfdDieBase). Fault injection (ranks/faults/) is no hook of the loop: a die a row
names plays it itself (a dead die falls silent through DieWatch.fall_silent), and the loop of a
die no row names runs nothing of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mpi4py import MPI

from ranks.core.messages import SHELL, TAG_STOP, FaultBegan
from xccl.recovery.rollback import Recovery, Released


class Failover(Protocol):
    """The watcher's word to a released die: go on without the dies `lost` (world ranks)."""

    lost: tuple[int, ...]


class DieWatch(Protocol):
    """A watched die's side of the heartbeats (§6.1), as the loop calls it. shell: the
    watcher's rank; is_dead: a dead row took effect (the die answers nothing); is_out: dead, or
    released by the watcher's fence (the die runs no iteration). `fall_silent` and `tell` are
    what fault injection (ranks/faults/) uses of it."""

    shell: int
    is_dead: bool

    @property
    def is_out(self) -> bool: ...

    def fall_silent(self) -> None:
        """A dead row took effect: the die answers nothing and runs no iteration from now on."""

    def tell(self, note: FaultBegan) -> None:
        """An injected fault's note to the watcher (for the failure record)."""

    def answer(self) -> None:
        """Between iterations: answer the heartbeats that arrived."""

    def released(self) -> None:
        """The fence released the die from a wait: out of the iterations."""

    def take_failover(self) -> Failover | None:
        """The watcher's Failover, if it arrived."""

    def rejoined(self) -> None:
        """The die rebuilt without the lost dies: it runs iterations again."""

    def idle(self) -> None:
        """A turn of a die that is out of the iterations."""

    def close(self, *, last: bool = True) -> None:
        """Before the dies' last collective with the watcher; `last`: with the last answer the
        watcher waits for (a lost die leaving sends none)."""


class DieRecompute(Protocol):
    """Token recomputation (§6.2 stage 3) as the loop reads it: recovery, the abort-word
    window's rollback (None without faults or heartbeats), whose fence the agreement checks."""

    recovery: Recovery | None

    def free(self) -> None:
        """The collective end of the abort-word window."""


class DecodeDieLoop:
    """Attributes a die sets: world (the world communicator), dies (the dies' communicator),
    mem (its first window), health (DieWatch, None when unwatched), recompute (DieRecompute),
    is_scaled (rebuilt without lost dies), is_lost (lost itself: it leaves without a
    collective)."""

    world: MPI.Comm
    dies: MPI.Comm
    health: DieWatch | None
    recompute: DieRecompute
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
        failover = None if health.is_dead else health.take_failover()
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
        self.health.close(last=False)
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
