"""An afd die's side of failure detection (xDeepServe §6.1), attention and expert dies alike: the
colocated die's parts (ranks/recovery/die_health.py) in the afd event loop.

  - The die answers the TE-shell's heartbeats from its loop only, between iterations; the
    `stuck` and `dead` rows naming it play there (a stuck die blocks in its A2E: an attention
    die's tokens staged, not yet announced; an expert die's forwarded or received rows).
  - The dies' agreement between iterations is one-sided (xccl/agreement.py), its wait checking
    the fence word: a lost die never writes its part, and the TE-shell's fence releases the
    others (xccl/recovery/rollback.py Released), as it releases them from their A2E/E2A waits.
  - A released die waits to be told which dies are lost and rebuilds without them
    (ranks/recovery/afd_failover.py); a lost one idles until the job's end, which it leaves without
    a
    collective.
"""

from __future__ import annotations

from mpi4py import MPI

from ranks.core.messages import TAG_STOP
from ranks.recovery.die_failover import take_failover
from ranks.recovery.die_health import DieHealth, is_watched
from xccl.recovery.rollback import Released

SHELL = 0


def make_health(ctx, die) -> DieHealth | None:
    """The die's heartbeat side when the TE-shell watches it (else None). die: the AfdDieBase;
    its fault rows count busy iterations, the same on every die."""
    if not is_watched(ctx.cfg, ctx.plan):
        return None
    return DieHealth(
        ctx.cfg,
        ctx.comm,
        iteration=lambda: die.iteration,
        virtual_s=lambda: die.clock.now_ns / 1e9,
    )


def watched_step(die) -> bool:
    """One turn of the die's event loop: heartbeats answered here only (§6.1), then an
    iteration (die.iterate()). A die released by the fence, or a dead one, only idles."""
    health = die.health
    if health is None:
        return die.iterate()
    health.check_dead()
    if health.is_out:
        return out_turn(die)
    health.answer()
    try:
        return die.iterate()
    except Released:
        health.released()
        return True


def out_turn(die) -> bool:
    """A turn out of the iterations: a released survivor rebuilds once told which dies are lost;
    a lost die idles until the TE-shell's stop (then `leave`)."""
    comm = die.ctx.comm
    failover = None if die.health.is_dead else take_failover(comm)
    if failover is not None:
        from ranks.recovery.afd_failover import scale_down

        scale_down(die, failover)
        die.health.is_released = False
        return True
    if comm.iprobe(source=SHELL, tag=TAG_STOP):
        comm.recv(source=SHELL, tag=TAG_STOP)
        die.is_lost = True
        return False
    die.health.idle()
    return True


def leave(die) -> None:
    """A lost die at the job's end: its own sends completed, what the TE-shell sent it meanwhile
    (requests, pings) taken, no collective."""
    outbox = getattr(die, "outbox", None)  # an attention die's tokens
    if outbox is not None:
        outbox.drain()
    die.health.close()
    comm = die.ctx.comm
    while (message := comm.improbe(source=SHELL, tag=MPI.ANY_TAG)) is not None:
        message.recv()
