"""Which EPLB side a colocated die gets: `EplbDie` (ranks/colocated/eplb.py, xDeepServe §4.5)
with `eplb.enabled`, else hooks that do nothing. Apart from eplb.py so that a die without EPLB
never imports it and its count records (~5 ms of start-up CPU per die)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpi4py import MPI

if TYPE_CHECKING:
    from ranks.colocated.eplb import EplbDie


class NoEplb:
    """EPLB disabled: the die's hooks do nothing."""

    def boundary_values(self) -> tuple[int, int]:
        return (0, 1)

    def at_boundary(self, agreed: tuple[int, int]) -> None:
        pass

    def is_waiting(self, is_stopped: bool) -> bool:
        return False

    def after_iteration(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def take_over(self, placement, version: int) -> None:
        raise AssertionError("no EPLB: a failover carries no EPLB placement")


def make_eplb_die(
    cfg, comm: MPI.Comm, executor, pricer, *, is_virtual: bool = False
) -> EplbDie | NoEplb:
    """is_virtual: serving on the virtual clock (the TE-shell decides every count slice)."""
    if not cfg.eplb.enabled:
        return NoEplb()
    # Lazy import, with EPLB only: a start-up cost of every other colocated die (docs/scale.md).
    from ranks.colocated.eplb import EplbDie

    return EplbDie(cfg, comm, executor, pricer, is_virtual=is_virtual)
