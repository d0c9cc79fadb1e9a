"""Fault injection into XCCL operations and what a buffer offers for recovery (xDeepServe §6.2).

Every XCCL buffer (EpBuffer, AfdBuffer, P2P) has two attributes, None by default (no cost):
    fault_hook(op, event_id)  called once per operation, inside it, at a point where peers are
                              left waiting (after staging, before publishing); it raises
                              InjectedFault to emulate a transient error of that operation.
    interrupt()               called on every turn of every wait; raises RollbackRequested when
                              another die signalled a failed attempt (xccl/recovery.py), so no
                              die stays deaf in a wait for a record that will never come.
and three methods the recovery coordinator drives (the `Realignable` protocol below):
    publication_state()       the buffer's publication numbers, a few ints;
    abandon()                 complete outstanding RMA, drop the attempt's bookkeeping;
    resync(state)             abandon, then move the publication numbers to `state`, the
                              element-wise max over every die, so that no doorbell left by the
                              failed attempt can ever equal one of the next attempt.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from xccl.errors import InjectedFault

# The operations a fault can hit (the same names as the config's faults.ops).
OPS = ("p2p_send", "p2p_recv", "dispatch", "combine", "a2e", "e2a")

FaultHook = Callable[[str, int], None]
Interrupt = Callable[[], None]
# decide(op, event_id) -> error code, or None for no fault
Decide = Callable[[str, int], "int | None"]


class Realignable(Protocol):
    def publication_state(self) -> tuple[int, ...]: ...

    def abandon(self) -> None: ...

    def resync(self, state: Sequence[int]) -> None: ...


def injector(die: int, decide: Decide) -> FaultHook:
    """A fault hook for die `die` that raises InjectedFault whenever decide(op, event) names a
    code."""
    def hook(op: str, event_id: int) -> None:
        if op not in OPS:
            raise ValueError(f"die rank {die}: fault hook called for unknown operation {op!r} "
                             f"(known: {', '.join(OPS)})")
        code = decide(op, event_id)
        if code is not None:
            raise InjectedFault(die, op, event_id, code)
    return hook
