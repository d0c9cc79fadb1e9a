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
(xccl/records.py ack_word).

Operations queue per (direction, peer) and advance only inside `progress()` (xccl/p2p_ops.py).
The receiving end (steps 5-7) lives in xccl/p2p_recv.py.

Restarting after an abandoned attempt (xccl/recovery.py): a pair may stop anywhere in a message:
the sender n publications in, the receiver m <= n consumed, an ack unwritten. The rule:
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
Fault hooks: "p2p_send" at a message's last publication, after its bytes were Put (not yet
flushed) and before its record; "p2p_recv" when a message's last record arrived, before the copy
and the ack, so for a message of several ring fills the pair stops mid-message. A fault leaves
the queues failed until abandon(), so no later transfer reuses the slots the failed one wrote.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from xccl import records
from xccl.errors import BufferTooSmall, UnknownPeer
from xccl.faults import FaultHook, Interrupt, RecoveryHooks
from xccl.gmem import DieMemory, as_bytes
from xccl.layout import RECORDS_PER_PAIR, P2PLayout
from xccl.p2p_lanes import RecvLane, SendLane
from xccl.p2p_ops import Handle, Op, OpQueues, Transfer
from xccl.p2p_recv import RingReceiver
from xccl.p2p_time import P2PTimes
from xccl.vclock import LinkModel, Path, VirtualClock

# Publications a sender may have unacknowledged per pair: the receiver copies one out while the
# sender fills the next (each at most half the ring). A record slot is reused only after its ack.
MAX_IN_FLIGHT = RECORDS_PER_PAIR


class P2P(RingReceiver):
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
        self.fault_hook: FaultHook | None = None  # (op, event_id), may raise InjectedFault
        self.interrupt: Interrupt | None = None  # every wait turn; may raise RollbackRequested

    def set_recovery(self, hooks: RecoveryHooks) -> None:
        """Install the recovery hooks (once, by the die's recomputer; xccl/faults.py)."""
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
        """Withdraw a receive whose sender never started the message (xccl/p2p_ops.py)."""
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
                self._published[dst], self._tail[dst] = published, tail
                self.mem.store_word(
                    self.me, self.layout.ack_offset(src, dst), records.ack_word(published)
                )
                self.mem.flush(self.me)
            if dst == self.me:
                self._consumed[src], self._rtail[src] = published, tail

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

    def _send_lane(self, dst: int) -> SendLane:
        lane = self._send_lanes.get(dst)
        if lane is None:
            lane = self._send_lanes[dst] = SendLane.build(self.mem, self.layout, self.me, dst)
        return lane

    def _send_steps(self, op: Op, data: np.ndarray, num_cores: int):
        lane = self._send_lane(op.peer)
        sent = chunk_id = publications = 0
        in_flight: deque[tuple[int, int]] = deque()  # (publication number, tail after it)
        acked_tail = self._tail.get(op.peer, 0)
        while True:
            if self._is_blocked(lane, in_flight, acked_tail, has_bytes_left=sent < data.nbytes):
                acked_tail = yield from self._wait_for_room(lane, in_flight, acked_tail)
            # Step 1-2 (Fig. 4): copy from the caller's buffer into the receiver's ring slots.
            # The record carries `num_cores` (the AIV cores that write in parallel), and the
            # virtual clock prices the split; the emulator writes each contiguous run at once.
            nbytes = self._put_slots(lane, data, sent, acked_tail, num_cores)
            if self.fault_hook is not None and sent + nbytes >= data.nbytes:
                # The message's last publication: its bytes are on the way, its record is not.
                self.fault_hook("p2p_send", op.event_id)
            # Step 3: advance the receiver's tail pointer: record body, flush, then the doorbell.
            in_flight.append(self._publish(lane, op, data.nbytes, nbytes, chunk_id, num_cores))
            sent += nbytes
            chunk_id += -(-nbytes // self.layout.slot_bytes)
            publications += 1
            if sent >= data.nbytes:
                break
        # Step 4 / 8: poll our metadata for the receiver's acks; the last one completes the send.
        while True:
            acked_tail = self._take_acks(lane, in_flight, acked_tail)
            if not in_flight:
                break
            yield ("the ack of publication {} (tail {})", *in_flight[-1])
        return Transfer(
            peer=op.peer,
            event_id=op.event_id,
            nbytes=data.nbytes,
            num_publications=publications,
            vtime_ns=self.clock.now_ns,
        )

    def _is_blocked(
        self, lane: SendLane, in_flight: deque, acked_tail: int, *, has_bytes_left: bool
    ) -> bool:
        """Flow control: at most MAX_IN_FLIGHT publications unacknowledged, slots to write into."""
        return len(in_flight) == MAX_IN_FLIGHT or (
            has_bytes_left and self._tail.get(lane.dst, 0) - acked_tail == self.layout.ring_slots
        )

    def _wait_for_room(self, lane: SendLane, in_flight: deque, acked_tail: int):
        """Yields while blocked (_is_blocked); returns the tail up to which the ring is free."""
        while True:
            acked_tail = self._take_acks(lane, in_flight, acked_tail)
            if not in_flight or not self._is_blocked(
                lane, in_flight, acked_tail, has_bytes_left=True
            ):
                return acked_tail
            yield ("the ack of publication {} (ring full)", in_flight[0][0])

    def _put_slots(
        self, lane: SendLane, data: np.ndarray, sent: int, acked_tail: int, num_cores: int
    ) -> int:
        """Write the next publication's bytes (at most the free slots, at most 1/MAX_IN_FLIGHT of
        the ring) from data[sent:] into the receiver's ring; returns how many."""
        layout, tail = self.layout, self._tail.get(lane.dst, 0)
        free_slots = min(layout.ring_slots - (tail - acked_tail), self._max_pub_slots)
        nbytes = min(data.nbytes - sent, free_slots * layout.slot_bytes)
        for ring_pos, msg_pos, length in layout.slot_runs(tail, nbytes):
            lane.write(ring_pos, data[sent + msg_pos : sent + msg_pos + length])
        return nbytes

    def _publish(
        self, lane: SendLane, op: Op, msg_bytes: int, nbytes: int, chunk_id: int, num_cores: int
    ) -> tuple[int, int]:
        """Write the record of a publication of `nbytes`; returns (its number, tail after it)."""
        dst = lane.dst
        tail = self._tail[dst] = self._tail.get(dst, 0) + -(-nbytes // self.layout.slot_bytes)
        seq = self._published[dst] = self._published.get(dst, 0) + 1
        # P2P_RECORD's fields after the doorbell (rung last, by publish), in order.
        body = (
            op.event_id,
            chunk_id,
            tail,
            self.times.stamp(dst, nbytes, num_cores),
            msg_bytes,
            nbytes,
            num_cores,
            self.path == "dma",
        )
        lane.records[seq % RECORDS_PER_PAIR].publish(body, seq)
        return seq, tail

    def _take_acks(self, lane: SendLane, in_flight: deque, acked_tail: int) -> int:
        """Retire acknowledged publications; returns the tail up to which the ring is free."""
        if not in_flight:
            return acked_tail
        word = lane.load_ack()
        while in_flight and records.ack_covers(word, in_flight[0][0]):
            _, acked_tail = in_flight.popleft()
            self.times.ack_lands(lane.dst, records.ack_time_ns(word))
        return acked_tail
