"""The sending end of a p2p pair (xDeepServe §3.1, Figure 4, steps 1-4 and 8), part of
xccl/p2p/channel.py P2P.

A message that fits one publication (half the ring) is copied into the receiver's ring, its
record published, its ack awaited. A larger one first asks where to go (a rendezvous):
  1. the sender publishes a record of kind P2P_RTS carrying the message size and no bytes;
  2. the receiver checks it like a first record (event, size against its buffer) and answers with
     its ack, the landing words before it (xccl/p2p/lanes.py): the offset of its receive buffer
     in its own window, when the caller received into window memory, or NO_LANDING;
  3. with an offset, the sender stores the whole message straight into that buffer and publishes
     one P2P_DIRECT record: one copy, as a raw Put makes, where the ring makes two (into the ring,
     out of it); without one, the message takes the ring as a small one does.
The rendezvous is the emulator's way of copying once on the host, not a step of Figure 4: the
virtual clock does not see the request or its ack, and prices a direct message as one
publication of all its bytes, which is what the ring's publications cost back to back (link
serialization, xccl/p2p/timing.py) without the waits for ring room of a message of more than
MAX_IN_FLIGHT publications.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from xccl.errors import XcclError
from xccl.gmem import DieMemory
from xccl.layout import RECORDS_PER_PAIR, P2PLayout
from xccl.p2p.lanes import SendLane
from xccl.p2p.ops import Op, Transfer
from xccl.p2p.timing import P2PTimes
from xccl.records import record as records
from xccl.records.record import P2P_DIRECT, P2P_RING, P2P_RTS
from xccl.recovery.faults import FaultHook

# Publications a sender may have unacknowledged per pair: the receiver copies one out while the
# sender fills the next (each at most half the ring). A record slot is reused only after its ack.
MAX_IN_FLIGHT = RECORDS_PER_PAIR


class RingSender:
    """Send steps of P2P; the attributes below are P2P's."""

    mem: DieMemory
    layout: P2PLayout
    me: int
    times: P2PTimes
    path: str
    fault_hook: FaultHook | None
    _published: dict[int, int]  # dst -> publications sent
    _tail: dict[int, int]  # dst -> slots written (the tail pointer)
    _send_lanes: dict[int, SendLane]  # dst -> this end of the pair, built once
    _max_pub_slots: int
    _max_pub_bytes: int

    def _send_lane(self, dst: int) -> SendLane:
        lane = self._send_lanes.get(dst)
        if lane is None:
            lane = self._send_lanes[dst] = SendLane.build(self.mem, self.layout, self.me, dst)
        return lane

    def _send_steps(self, op: Op, data: np.ndarray, num_cores: int):
        lane = self._send_lane(op.peer)
        if data.nbytes > self._max_pub_bytes:
            landing = yield from self._rendezvous(lane, op, data.nbytes, num_cores)
            if landing is not None:
                return (yield from self._send_direct(lane, op, data, landing, num_cores))
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
        yield from self._wait_for_acks(lane, in_flight, acked_tail)
        return self._transfer(op, data.nbytes, publications, direct=False)

    def _rendezvous(self, lane: SendLane, op: Op, msg_bytes: int, num_cores: int):
        """Ask dst where `msg_bytes` should go (the module docstring); returns the landing."""
        dst = lane.dst
        seq = self._published[dst] = self._published.get(dst, 0) + 1
        body = (op.event_id, 0, self._tail.get(dst, 0), self.clock.now_ns, msg_bytes, 0)
        lane.records[seq % RECORDS_PER_PAIR].publish(
            (*body, num_cores, self.path == "dma", P2P_RTS), seq
        )
        while not records.ack_covers(lane.load_ack(), seq):
            yield ("the receiver's landing for publication {}", seq)
        return lane.read_landing(seq)

    def _send_direct(
        self, lane: SendLane, op: Op, data: np.ndarray, landing: tuple[int, int], num_cores: int
    ):
        """Store the whole message at the receiver's landing, publish it, await its ack."""
        offset, capacity = landing
        if capacity < data.nbytes:  # the receiver refuses a short buffer before it answers
            raise XcclError(
                self.describe(op, f"rank {lane.dst} offered a landing of only {capacity} B")
            )
        lane.write_at(offset, data)
        if self.fault_hook is not None:
            self.fault_hook("p2p_send", op.event_id)
        in_flight = deque(
            [self._publish(lane, op, data.nbytes, data.nbytes, 0, num_cores, P2P_DIRECT)]
        )
        yield from self._wait_for_acks(lane, in_flight, self._tail.get(lane.dst, 0))
        return self._transfer(op, data.nbytes, 1, direct=True)

    def _wait_for_acks(self, lane: SendLane, in_flight: deque, acked_tail: int):
        # Step 4 / 8: poll our metadata for the receiver's acks; the last one completes the send.
        while True:
            acked_tail = self._take_acks(lane, in_flight, acked_tail)
            if not in_flight:
                return
            yield ("the ack of publication {} (tail {})", *in_flight[-1])

    def _transfer(self, op: Op, nbytes: int, publications: int, *, direct: bool) -> Transfer:
        return Transfer(
            peer=op.peer,
            event_id=op.event_id,
            nbytes=nbytes,
            num_publications=publications,
            vtime_ns=self.clock.now_ns,
            direct=direct,
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
        self,
        lane: SendLane,
        op: Op,
        msg_bytes: int,
        nbytes: int,
        chunk_id: int,
        num_cores: int,
        kind: int = P2P_RING,
    ) -> tuple[int, int]:
        """Write the record of a publication of `nbytes`; returns (its number, tail after it).
        A direct publication takes no ring slots: the tail stays."""
        dst = lane.dst
        slots = -(-nbytes // self.layout.slot_bytes) if kind == P2P_RING else 0
        tail = self._tail[dst] = self._tail.get(dst, 0) + slots
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
            kind,
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
