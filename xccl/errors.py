"""XCCL's errors. Every message names the dies involved, the event and the sizes."""


class XcclError(RuntimeError):
    """Base class of every XCCL error."""


class XcclTimeout(XcclError, TimeoutError):
    """A wait passed its deadline (die, peer, event named)."""


class PeerTimeout(XcclTimeout):
    """A wait for peers' records passed xccl.poll_timeout_s (xccl/records/record.py): die, the
    waiting die's rank; op, the stage ("dispatch", "combine", ...); event_id; peers, the ranks whose
    records are missing; since: when the wait began (time.time(), -1 unknown). With recovery on
    (xccl/recovery/rollback.py, recover_timeouts) it is a fault of the attempt like an injected one:
    the iteration is recomputed."""

    def __init__(
        self, message: str, *, die: int, op: str, event_id: int, peers: tuple, since: float = -1.0
    ) -> None:
        super().__init__(message)
        self.die, self.op, self.event_id, self.peers = die, op, event_id, tuple(peers)
        self.since = since

    def __reduce__(self):
        args = (str(self), self.die, self.op, self.event_id, self.peers, self.since)
        return _rebuild_peer_timeout, args


def _rebuild_peer_timeout(message, die, op, event_id, peers, since) -> PeerTimeout:
    return PeerTimeout(message, die=die, op=op, event_id=event_id, peers=peers, since=since)


class EventMismatch(XcclError):
    """A record carried another event id than the caller expected: stale or misrouted data."""


class BufferTooSmall(XcclError, ValueError):
    """The caller's buffer cannot hold what arrives (or what is to be staged)."""


class UnknownPeer(XcclError, ValueError):
    """A peer outside the communicator, or a pair the layout does not provide a ring for."""


class OutOfWindow(XcclError, IndexError):
    """An RMA access outside the target's window: refused before MPI sees it."""


class InjectedFault(XcclError):
    """An emulated transient XCCL error (xDeepServe §6.2 stage 3), raised by a buffer's fault hook
    inside an operation, where peers are left waiting. die: the die's rank; op: the operation
    (xccl.recovery.faults.OPS); event_id: the operation's event; code: the error code."""

    def __init__(self, die: int, op: str, event_id: int, code: int) -> None:
        super().__init__(f"die rank {die}: injected fault (code {code}) in {op} event {event_id}")
        self.die, self.op, self.event_id, self.code = die, op, event_id, code

    def __reduce__(self):
        return type(self), (self.die, self.op, self.event_id, self.code)


class RollbackRequested(XcclError):
    """Raised inside a wait when another die signalled that the current attempt failed: abandon
    it and vote (xccl/recovery/rollback.py). epoch: the attempt's epoch (failed attempts before it).
    waiting: what the interrupted wait waited for, (waiting die's rank, lowest missing peer,
    since when: time.time()), set by the wait that knows (xccl/records/record.py, xccl/afd/loop.py);
    None when unknown. The vote carries it so that a timeout is blamed on the die the waits
    lead to, not on a die that was itself waiting (xccl/recovery/vote.py)."""

    def __init__(self, die: int, epoch: int) -> None:
        super().__init__(
            f"die rank {die}: attempt of epoch {epoch} abandoned: another die "
            "signalled a failed XCCL operation"
        )
        self.die, self.epoch = die, epoch
        self.waiting: tuple[int, int, float] | None = None

    def __reduce__(self):
        return type(self), (self.die, self.epoch)


class RetriesExhausted(XcclError):
    """An attempt failed again after the allowed re-executions (every die raises the same)."""
