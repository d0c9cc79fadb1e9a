"""Fault injection into XCCL operations and what a buffer offers for recovery (xDeepServe §6.2).

Every XCCL buffer (EpBuffer, AfdBuffer, P2P) takes its `RecoveryHooks` once, through
`set_recovery(hooks)` (none by default: no cost), and offers three methods the recovery
coordinator drives (the `Realignable` protocol below):
    publication_state()       the buffer's publication numbers, a few ints;
    abandon()                 complete outstanding RMA, drop the attempt's bookkeeping;
    resync(state)             abandon, then move the publication numbers to `state`, the
                              element-wise max over every die, so that no doorbell left by the
                              failed attempt can ever equal one of the next attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

# The operations a fault can hit (the same names as the config's faults.ops).
OPS = ("p2p_send", "p2p_recv", "dispatch", "combine", "a2e", "e2a")

FaultHook = Callable[[str, int], None]
Interrupt = Callable[[], None]


@dataclass(frozen=True, kw_only=True)
class RecoveryHooks:
    """What a buffer calls for recovery; each None = not called (no cost).

    interrupt()               on every turn of every wait; raises RollbackRequested when
                              another die signalled a failed attempt (xccl/recovery/rollback.py), so
                              no die stays deaf in a wait for a record that will never come.
    fault_hook(op, event_id)  once per operation, inside it, at a point where peers are left
                              waiting (after staging, before publishing); it raises
                              InjectedFault to emulate a transient error of that operation.
                              One object for the whole run: it learns the attempt from its owner.
    """

    interrupt: Interrupt | None = None
    fault_hook: FaultHook | None = None


class Realignable(Protocol):
    def publication_state(self) -> tuple[int, ...]: ...

    def abandon(self) -> None: ...

    def resync(self, state: Sequence[int]) -> None: ...


class RecoverableBuffer(Realignable, Protocol):
    """A buffer a die's recomputer drives: realigned by the vote, hooked once."""

    def set_recovery(self, hooks: RecoveryHooks) -> None: ...
