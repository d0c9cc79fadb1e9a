"""p2p transfers in flight (xccl/p2p/channel.py): what a completed one did, its handle, and the
queues.

Operations queue per (direction, peer) and advance only inside `progress()`, which every handle's
`test()` / `wait()` calls, so async transfers make progress whenever the caller checks on any of
them and never busy-wait while it computes. A fault raised inside `progress()` leaves the queues
failed (every later `progress()` raises it again) until `abandon()`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xccl.errors import InjectedFault, XcclError
from xccl.records.mpi_time import poll_until

if TYPE_CHECKING:
    from xccl.p2p.channel import P2P


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """What a completed send or receive did.

    peer: the other die's rank. event_id: the caller's event id. nbytes: message size.
    num_publications: publications of its bytes (ring fills, or 1 when direct). vtime_ns: this
    die's virtual clock at completion. direct: it landed straight in the receiver's buffer
    (xccl/p2p/send.py), not through the ring.
    """

    peer: int
    event_id: int
    nbytes: int
    num_publications: int
    vtime_ns: float
    direct: bool = False


class Op:
    """One send or receive: its protocol steps and, once done, its result or error.

    The steps are a generator that yields what it waits for as a format string and its
    arguments (`waiting_for`), formatted only when a message needs it: a wait turn then costs
    no string formatting."""

    def __init__(self, kind: str, peer: int, event_id: int, nbytes: int) -> None:
        self.kind, self.peer, self.event_id, self.nbytes = kind, peer, event_id, nbytes
        self.steps: Generator[tuple, None, Transfer] | None = None
        self.waiting_for: tuple = ("its turn on the pair",)
        self.result: Transfer | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def describe(self, me: int, what: str) -> str:
        arrow = "to" if self.kind == "send" else "from"
        template, *args = self.waiting_for
        waiting = f", waiting for {template.format(*args)}" if self.steps is not None else ""
        return (
            f"die rank {me}: {self.kind} of {self.nbytes} B {arrow} rank {self.peer}, event "
            f"{self.event_id}: {what}{waiting}"
        )


class Handle:
    """An in-flight send or receive. `test()` advances all transfers and says if this one is done;
    `wait()` blocks (yielding the CPU) until it is, raising its error or XcclTimeout."""

    def __init__(self, p2p: P2P, op: Op) -> None:
        self._p2p, self._op = p2p, op

    def test(self) -> bool:
        if not self._op.done:
            self._p2p.progress()
        return self._op.done

    def wait(self, timeout_s: float | None = None) -> Transfer:
        p2p, op = self._p2p, self._op
        timeout_s = p2p.timeout_s if timeout_s is None else timeout_s
        poll_until(
            self.test,
            deadline=time.monotonic() + timeout_s,
            interrupt=p2p.interrupt,
            describe=lambda: p2p.describe(op, f"no progress after {timeout_s:g} s"),
        )
        if op.error is not None:
            raise op.error
        return op.result


class OpQueues:
    """The transfers of one P2P object, queued per (direction, peer): one at a time per queue."""

    def __init__(self) -> None:
        self._queues: dict[tuple[str, int], deque[Op]] = {}
        self.fault: InjectedFault | None = None  # set by a fault hook, cleared by abandon()

    def add(self, op: Op) -> None:
        self._queues.setdefault((op.kind, op.peer), deque()).append(op)

    def progress(self) -> None:
        """Advance every queued transfer as far as it goes without waiting."""
        if self.fault is not None:
            raise self.fault
        for queue in self._queues.values():
            while queue:
                op = queue[0]
                try:
                    op.waiting_for = next(op.steps)
                    break  # blocked: the next op on this pair waits its turn
                except StopIteration as stop:
                    op.result = stop.value
                except InjectedFault as fault:
                    op.error = self.fault = fault
                    raise
                except XcclError as exc:
                    op.error = exc
                queue.popleft()

    def cancel(self, op: Op, me: int) -> None:
        """Withdraw one receive whose sender never published any of its message (a KV transfer
        re-routed over another pair): the operations behind it on the pair move up."""
        queue = self._queues.get((op.kind, op.peer))
        if op.done or queue is None or op not in queue:
            return
        queue.remove(op)
        op.error = XcclError(op.describe(me, "cancelled"))

    def abandon(self, me: int) -> None:
        """Fail every queued transfer (its handle raises) and forget the fault."""
        for queue in self._queues.values():
            for op in queue:
                if not op.done:
                    op.error = XcclError(op.describe(me, "abandoned by a rollback"))
        self._queues.clear()
        self.fault = None
