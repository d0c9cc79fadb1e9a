"""The vote's message (xccl/recovery/rollback.py step 3): what one die says about an attempt, as
int64 words, and what every die reads back from all of them.

Per die: notified, has fault, fault die, op index, event id, code, peer, then what the die was
waiting for when its attempt ended (waiting die, peer, since in microseconds of time.time(); -1:
not waiting), when its wait timed out (us of time.time(), -1: it did not), then the publication
states. An injected fault carries its error code (> 0, faults.table) and no peer; a wait that
timed out (xccl.errors.PeerTimeout) carries TIMEOUT_CODE and the first peer it waited for.

Whom a timeout blames: the die that timed out may have waited for a die that itself waited (an
expert die for a trampoline that waits for a stalled attention die; the others leave their waits
when the first timeout notifies them, so only one die reports a timeout). Outcome.blamed follows
the waits from the timed-out die's peer to a die that was not waiting: the slow one. A stalled die
that comes back and is interrupted in its next wait closes a cycle; in a cycle the die whose wait
began last is blamed (the others were already waiting while it was busy elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xccl.errors import InjectedFault, PeerTimeout
from xccl.recovery.faults import OPS

HEADER = 11
WAIT = 7  # waiting die, peer, since (us)
TIMED_OUT = 10  # when this die's wait timed out (us)
TIMEOUT_CODE = 0  # injected faults have codes > 0 (xds_mpi/config/faults.py)


@dataclass(frozen=True, kw_only=True)
class FaultReport:
    """One die's fault in an attempt: the die it names, the operation, its event id, the code
    (TIMEOUT_CODE: the die's wait timed out); peer: the die it waited for (timeouts), else -1;
    at_us: when the wait timed out (time.time() in us), else -1."""

    die: int
    op: str
    event_id: int
    code: int
    peer: int = -1
    at_us: int = -1

    @property
    def is_timeout(self) -> bool:
        return self.code == TIMEOUT_CODE

    def __str__(self) -> str:
        if self.is_timeout:
            return f"die {self.die} {self.op} event {self.event_id} timed out on die {self.peer}"
        return f"die {self.die} {self.op} event {self.event_id} code {self.code}"


@dataclass(frozen=True)
class Waiting:
    """A die that ended its attempt waiting: for `peer` since `since_us` (time.time() in us)."""

    die: int
    peer: int
    since_us: int


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
    waits: tuple[Waiting, ...] = ()

    @property
    def timeouts(self) -> tuple[FaultReport, ...]:
        return tuple(f for f in self.faults if f.is_timeout)

    def blamed(self, timeout: FaultReport) -> int:
        """The die `timeout`'s wait leads to: its peer, or, while that peer was itself waiting,
        the die that one waited for, and so on (a cycle: its latest waiter)."""
        waiting = {w.die: w for w in self.waits}
        chain, peer = [timeout.die], timeout.peer
        while peer in waiting and peer not in chain:
            chain.append(peer)
            peer = waiting[peer].peer
        if peer not in chain:
            return peer
        cycle = chain[chain.index(peer) :]
        return max(cycle, key=lambda die: waiting[die].since_us if die in waiting else -1)


Fault = InjectedFault | PeerTimeout


def encode(
    send: np.ndarray,
    *,
    notified: bool,
    fault: Fault | None,
    states: Sequence[int],
    waiting: tuple[int, int, float] | None = None,
    timed_out_at: float = -1.0,
) -> None:
    """This die's words into `send` (zeroed first). waiting: (die, peer, since: time.time())
    of the wait a rollback interrupted (RollbackRequested.waiting), None if none;
    timed_out_at: when a PeerTimeout `fault` was raised (time.time()), -1 unknown."""
    send[:] = 0
    send[0] = notified or fault is not None
    send[WAIT:HEADER] = -1
    if isinstance(fault, PeerTimeout) and timed_out_at >= 0:
        send[TIMED_OUT] = int(timed_out_at * 1e6)
    if isinstance(fault, PeerTimeout):
        peer = min(fault.peers, default=-1)
        send[1:WAIT] = (1, fault.die, _op_index(fault.op), fault.event_id, TIMEOUT_CODE, peer)
        waiting = (fault.die, peer, fault.since) if peer >= 0 and fault.since >= 0 else None
    elif fault is not None:
        send[1:WAIT] = (1, fault.die, _op_index(fault.op), fault.event_id, fault.code, -1)
    if waiting is not None:
        die, peer, since = waiting
        send[WAIT:TIMED_OUT] = (die, peer, int(since * 1e6))
    send[HEADER : HEADER + len(states)] = states


def decode(rows: list[list[int]], epoch: int) -> Outcome:
    """Every die's words (`rows`, [dies][words]) -> the outcome; epoch: before this vote."""
    faults = tuple(
        FaultReport(
            die=r[2],
            op=OPS[r[3]] if r[3] >= 0 else "?",
            event_id=r[4],
            code=r[5],
            peer=r[6],
            at_us=r[TIMED_OUT],
        )
        for r in rows
        if r[1]
    )
    failed = any(r[0] for r in rows)
    merged = tuple(max(column) for column in zip(*(r[HEADER:] for r in rows)))
    waits = tuple(Waiting(r[WAIT], r[WAIT + 1], r[WAIT + 2]) for r in rows if r[WAIT] >= 0)
    return Outcome(failed=failed, epoch=epoch + failed, faults=faults, states=merged, waits=waits)


def _op_index(op: str) -> int:
    """The stage's index in OPS; AFD stages are named "A2E", "A2E'", "E2A'" (xccl/afd/buffer.py)."""
    name = op.lower().rstrip("'")
    return OPS.index(name) if name in OPS else -1
