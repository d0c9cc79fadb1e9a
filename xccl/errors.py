"""XCCL's errors. Every message names the dies involved, the event and the sizes."""


class XcclError(RuntimeError):
    """Base class of every XCCL error."""


class XcclTimeout(XcclError, TimeoutError):
    """A wait passed its deadline (die, peer, event named)."""


class EventMismatch(XcclError):
    """A record carried another event id than the caller expected: stale or misrouted data."""


class BufferTooSmall(XcclError, ValueError):
    """The caller's buffer cannot hold what arrives (or what is to be staged)."""


class UnknownPeer(XcclError, ValueError):
    """A peer outside the communicator, or a pair the layout does not provide a ring for."""


class OutOfWindow(XcclError, IndexError):
    """An RMA access outside the target's window: refused before MPI sees it."""
