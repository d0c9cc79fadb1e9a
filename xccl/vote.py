"""The vote's message (xccl/recovery.py step 3): what one die says about an attempt, as int64
words, and what every die reads back from all of them.

Per die: notified, has fault, fault die, op index, event id, code, peer, then the publication
states. An injected fault carries its error code (> 0, faults.table) and no peer; a wait that
timed out (xccl.errors.PeerTimeout) carries TIMEOUT_CODE and the first peer it waited for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xccl.errors import InjectedFault, PeerTimeout
from xccl.faults import OPS

HEADER = 7
TIMEOUT_CODE = 0  # injected faults have codes > 0 (xds_mpi/config_faults.py)


@dataclass(frozen=True, kw_only=True)
class FaultReport:
    """One die's fault in an attempt: the die it names, the operation, its event id, the code
    (TIMEOUT_CODE: the die's wait timed out); peer: the die it waited for (timeouts), else -1."""

    die: int
    op: str
    event_id: int
    code: int
    peer: int = -1

    @property
    def is_timeout(self) -> bool:
        return self.code == TIMEOUT_CODE

    def __str__(self) -> str:
        if self.is_timeout:
            return f"die {self.die} {self.op} event {self.event_id} timed out on die {self.peer}"
        return f"die {self.die} {self.op} event {self.event_id} code {self.code}"


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What the vote decided, identical on every die.

    failed: some die reported a fault or notified. epoch: failed attempts so far, this one
    included. faults: every reported fault, by rank. states: the element-wise max over all dies
    of the `states` voted (as long as this die's), to resync the buffers with.
    """

    failed: bool
    epoch: int
    faults: tuple[FaultReport, ...]
    states: tuple[int, ...]

    @property
    def timeouts(self) -> tuple[FaultReport, ...]:
        return tuple(f for f in self.faults if f.is_timeout)


Fault = InjectedFault | PeerTimeout


def encode(send: np.ndarray, *, notified: bool, fault: Fault | None, states: Sequence[int]) -> None:
    """This die's words into `send` (zeroed first)."""
    send[:] = 0
    send[0] = notified or fault is not None
    if isinstance(fault, PeerTimeout):
        peer = min(fault.peers, default=-1)
        send[1:HEADER] = (1, fault.die, _op_index(fault.op), fault.event_id, TIMEOUT_CODE, peer)
    elif fault is not None:
        send[1:HEADER] = (1, fault.die, _op_index(fault.op), fault.event_id, fault.code, -1)
    send[HEADER : HEADER + len(states)] = states


def decode(rows: list[list[int]], epoch: int) -> Outcome:
    """Every die's words (`rows`, [dies][words]) -> the outcome; epoch: before this vote."""
    faults = tuple(
        FaultReport(
            die=r[2], op=OPS[r[3]] if r[3] >= 0 else "?", event_id=r[4], code=r[5], peer=r[6]
        )
        for r in rows
        if r[1]
    )
    failed = any(r[0] for r in rows)
    merged = tuple(max(column) for column in zip(*(r[HEADER:] for r in rows)))
    return Outcome(failed=failed, epoch=epoch + failed, faults=faults, states=merged)


def _op_index(op: str) -> int:
    """The stage's index in OPS; AFD stages are named "A2E", "A2E'", "E2A'" (xccl/afd.py)."""
    name = op.lower().rstrip("'")
    return OPS.index(name) if name in OPS else -1
