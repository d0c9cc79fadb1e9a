"""Point-to-point send / receive over per-pair ring buffers (xDeepServe §3.1, Figure 4).

The sender copies its message into the ring it owns in the receiver's window and publishes a
record (event id, chunk id, tail pointer, its virtual time, sizes) in the receiver's metadata; the
receiver copies the slots out and acknowledges in the sender's metadata. A message larger than the
ring goes in several publications: each fills at most half the ring, and at most MAX_IN_FLIGHT
(two) are unacknowledged at once, so the receiver reads one while the sender writes the next;
an ack frees its slots (flow control), chunk ids counting slots from the message's start.

A record is written body first, flushed, then its one-word doorbell (the publication number), so
a receiver never acts on a half-written record; each publication in flight has a record of its
own (RECORDS_PER_PAIR per pair), so a record is never rewritten while its receiver reads it.
The ack is one atomic word: the publication number and the receiver's virtual time
(xccl/records/record.py ack_word).

Operations queue per (direction, peer) and advance only inside `progress()` (xccl/p2p/ops.py).
The sending end (steps 1-4, 8, and the rendezvous of a message larger than one publication, which
lands it with one copy when the receive buffer is window memory) lives in xccl/p2p/send.py, the
receiving end (steps 5-7) in xccl/p2p/recv.py.

Restarting after an abandoned attempt (xccl/recovery/rollback.py): a pair may stop anywhere in a
message: the sender n publications in, the receiver m <= n consumed, an ack unwritten. The rule:
  1. abandon(): complete this die's outstanding RMA and fail every queued transfer (a transfer
     belongs to the attempt that started it; the caller starts it again, from its first byte);
  2. every die agrees on P >= every publication number and T >= every ring position any die has
     used on any pair (publication_state(), max over all dies: the vote);
  3. resync((P, T)): both ends of every pair continue from publication P and ring position T (the
     receiver's expected tail equals the sender's), and the sender rewrites its own ack words to
     "P acknowledged". The next publication, P + 1, matches no doorbell left behind (all <= P),
     no stale ack (a 16-bit number compared modulo 2^16) can retire it, and the whole ring is
     free. Nobody writes into the pair between 1 and 3: every die left the attempt, and its acks
     and records were flushed, before the vote.
Restarting one pair alone (P2P.pair_state / resync_pair): a KV transfer between one prefill
and one decode die is retried between those two, without touching the dies' other pairs. Both
ends `abandon()` (each has only that transfer in flight), exchange `pair_state` over the control
plane, and both `resync_pair` to the element-wise max. As in the rule above, the next
publication is numbered past every doorbell the failed attempt left, the receiver expects the
sender's tail, and the sender's ack word says "all acknowledged".
Fault hooks: "p2p_send" at a message's last publication, after its bytes were Put (not yet
flushed) and before its record; "p2p_recv" when a message's last record arrived, before the copy
and the ack, so for a message of several ring fills the pair stops mid-message. A fault leaves
the queues failed until abandon(), so no later transfer reuses the slots the failed one wrote.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from xccl import records
from xccl.errors import BufferTooSmall, UnknownPeer
from xccl.gmem import DieMemory, as_bytes
from xccl.layout import P2PLayout
from xccl.p2p.ops import Op, OpQueues, Transfer
from xccl.p2p.recv import RecvLane, RingReceiver
from xccl.p2p.send import MAX_IN_FLIGHT, RingSender, SendLane
from xccl.p2p.timing import P2PTimes
from xccl.recovery.faults import FaultHook, Interrupt, RecoveryHooks
from xccl.vclock import LinkModel, Path, VirtualClock
from xccl.wake import poll_until


class P2P(RingSender, RingReceiver):
    """send / receive between this die and the peers its layout pairs it with."""

    def __init__(
        self,
        mem: DieMemory,
        layout: P2PLayout,
        *,
        clock: VirtualClock | None = None,
        link: LinkModel | None = None,
        num_cores: int = 2,
        path: Path = "mte",
        timeout_s: float = 60.0,
        server_of: Sequence[int] | None = None,
        event_base: int = 0,
    ) -> None:
        if mem.nbytes < layout.window_bytes(mem.rank):
            raise BufferTooSmall(
                f"rank {mem.rank}: window of {mem.nbytes} B < the "
                f"{layout.window_bytes(mem.rank)} B the p2p layout needs"
            )
        mem.claim("p2p")
        self.mem, self.layout, self.me = mem, layout, mem.rank
        self.times = P2PTimes(mem.rank, clock or VirtualClock(), link, path, server_of)
        self.num_cores, self.path, self.timeout_s = num_cores, path, timeout_s
        self._published = {}  # dst -> publications sent
        self._tail = {}  # dst -> slots written (the tail pointer)
        self._consumed = {}  # src -> publications consumed
        self._rtail = {}  # src -> slots consumed
        self._ops = OpQueues()
        self._send_lanes: dict[int, SendLane] = {}  # dst -> this end of the pair, built once
        self._recv_lanes: dict[int, RecvLane] = {}  # src -> this end of the pair, built once
        self._max_pub_slots = max(1, layout.ring_slots // MAX_IN_FLIGHT)
        self._max_pub_bytes = self._max_pub_slots * layout.slot_bytes
        self.fault_hook: FaultHook | None = None  # (op, event_id), may raise InjectedFault
        self.interrupt: Interrupt | None = None  # every wait turn; may raise RollbackRequested

    def set_recovery(self, hooks: RecoveryHooks) -> None:
        """Install the recovery hooks (once, by the die's recomputer; xccl/recovery/faults.py)."""
        self.interrupt, self.fault_hook = hooks.interrupt, hooks.fault_hook

    # -- API ------------------------------------------------------------------------------------
    def isend(
        self, data: np.ndarray, dst: int, event_id: int, *, num_cores: int | None = None
    ) -> Handle:
        """Start sending `data` (any contiguous array; its bytes are sent) to `dst`.
        The caller must not change `data` until the handle completes."""
        raw = as_bytes(np.ascontiguousarray(data))
        op = Op("send", dst, event_id, raw.nbytes)
        self._check_pair(op, self.me, dst)
        op.steps = self._send_steps(op, raw, num_cores or self.num_cores)
        self._ops.add(op)
        return Handle(self, op)

    def irecv(self, out: np.ndarray, src: int, event_id: int) -> Handle:
        """Start receiving from `src` into `out` (contiguous; its first nbytes are written)."""
        raw = as_bytes(out)
        op = Op("recv", src, event_id, raw.nbytes)
        self._check_pair(op, src, self.me)
        op.steps = self._recv_steps(op, raw)
        self._ops.add(op)
        return Handle(self, op)

    def send(
        self, data: np.ndarray, dst: int, event_id: int, *, num_cores: int | None = None
    ) -> Transfer:
        """Synchronous send: returns after the receiver acknowledged the whole message."""
        return self.isend(data, dst, event_id, num_cores=num_cores).wait()

    def recv(self, out: np.ndarray, src: int, event_id: int) -> Transfer:
        return self.irecv(out, src, event_id).wait()

    def cancel(self, handle: Handle) -> None:
        """Withdraw a receive whose sender never started the message (xccl/p2p/ops.py)."""
        self._ops.cancel(handle._op, self.me)

    def set_clock(self, clock: VirtualClock) -> None:
        """Switch to another virtual clock (e.g. a fresh one for a measurement)."""
        self.times.set_clock(clock)

    @property
    def clock(self) -> VirtualClock:
        return self.times.clock

    def progress(self) -> None:
        """Advance every queued transfer as far as it goes without waiting."""
        self._ops.progress()

    def describe(self, op: Op, what: str) -> str:
        return op.describe(self.me, what)

    # -- recovery (the restart rule in the module docstring) -------------------------------
    def publication_state(self) -> tuple[int, int]:
        """(highest publication number, highest ring position) over this die's pairs."""
        return (
            max([*self._published.values(), *self._consumed.values()], default=0),
            max([*self._tail.values(), *self._rtail.values()], default=0),
        )

    def abandon(self) -> None:
        """Complete outstanding RMA and fail every queued transfer (its handle raises)."""
        self.mem.flush_all()
        self._ops.abandon(self.me)

    def resync(self, state) -> None:
        """Abandon, then continue every pair from publication P and ring position T = `state`,
        the max over all dies."""
        self.abandon()
        published, tail = (int(v) for v in state)
        have = self.publication_state()
        if published < have[0] or tail < have[1]:
            raise ValueError(
                f"die rank {self.me}: resync to publication {published}, ring "
                f"position {tail} would go back from {have}"
            )
        for src, dst in self.layout.pairs:
            if src == self.me:
                self._move_sender(dst, published, tail)
            if dst == self.me:
                self._consumed[src], self._rtail[src] = published, tail

    def pair_state(self, src: int, dst: int) -> tuple[int, int]:
        """(publications, ring position) of the pair src -> dst at this end of it."""
        if self.me == src:
            return self._published.get(dst, 0), self._tail.get(dst, 0)
        return self._consumed.get(src, 0), self._rtail.get(src, 0)

    def resync_pair(self, src: int, dst: int, state: tuple[int, int]) -> None:
        """Continue the pair src -> dst alone from `state` (the max of both ends' pair_state)."""
        published, tail = (int(v) for v in state)
        have = self.pair_state(src, dst)
        if published < have[0] or tail < have[1]:
            raise ValueError(
                f"die rank {self.me}: pair {src} -> {dst} resync to publication {published}, "
                f"ring position {tail} would go back from {have}"
            )
        if self.me == src:
            self._move_sender(dst, published, tail)
        else:
            self._consumed[src], self._rtail[src] = published, tail

    def _move_sender(self, dst: int, published: int, tail: int) -> None:
        """Our end of me -> dst continues from publication `published`, ring position `tail`,
        and our ack word says "all acknowledged"."""
        self._published[dst], self._tail[dst] = published, tail
        ack_at = self.layout.ack_offset(self.me, dst)
        self.mem.store_word(self.me, ack_at, records.ack_word(published))
        self.mem.flush(self.me)

    # -- protocol -------------------------------------------------------------------------------
    def _check_pair(self, op: Op, src: int, dst: int) -> None:
        """Refuse an unknown peer at the call, naming both dies, the event and the size."""
        num_ranks = self.layout.num_ranks
        if not 0 <= op.peer < num_ranks:
            raise UnknownPeer(
                self.describe(op, f"rank {op.peer} is outside ranks 0..{num_ranks - 1}")
            )
        if (src, dst) not in self.layout.pairs:
            raise UnknownPeer(
                self.describe(op, f"the deployment declares no ring for rank {src} -> rank {dst}")
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
            serve=p2p.mem.far_server,
            describe=lambda: p2p.describe(op, f"no progress after {timeout_s:g} s"),
        )
        if op.error is not None:
            raise op.error
        return op.result


# The single-pair restart as functions of a P2P, as the PD ranks call it.
pair_state, resync_pair = P2P.pair_state, P2P.resync_pair
