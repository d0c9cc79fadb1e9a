"""The receiving end of a p2p ring (xDeepServe §3.1, Figure 4, steps 5-7), part of
xccl/p2p/channel.py P2P.

A receive polls its metadata for the sender's next record, checks it (chunk id, tail pointer,
message size against the caller's buffer), copies the publication's slots out of the ring and
acknowledges in the sender's metadata, until the whole message arrived. A rendezvous request
(P2P_RTS, xccl/p2p/send.py) is answered with the landing words in the ack: where the receive
buffer sits in this die's window, if it does; a direct publication then needs no copy. P2P
mixes this in: it owns the window, the layout, the virtual times, the fault hook and the
per-source counters advanced here (the restart rule in xccl/p2p/channel.py moves them).
"""

from __future__ import annotations

import numpy as np

from xccl.errors import BufferTooSmall, XcclError
from xccl.gmem import DieMemory
from xccl.layout import RECORDS_PER_PAIR, P2PLayout
from xccl.p2p.lanes import NO_LANDING, RecvLane, window_offset
from xccl.p2p.ops import Op, Transfer
from xccl.p2p.timing import P2PTimes
from xccl.records import record as records
from xccl.records.record import P2P_DIRECT, P2P_RTS
from xccl.recovery.faults import FaultHook


class RingReceiver:
    """Receive steps of P2P; the attributes below are P2P's."""

    mem: DieMemory
    layout: P2PLayout
    me: int
    times: P2PTimes
    fault_hook: FaultHook | None
    _consumed: dict[int, int]  # src -> publications consumed
    _rtail: dict[int, int]  # src -> slots consumed
    _recv_lanes: dict[int, RecvLane]  # src -> this end of the pair, built once

    def _recv_lane(self, src: int) -> RecvLane:
        lane = self._recv_lanes.get(src)
        if lane is None:
            lane = self._recv_lanes[src] = RecvLane.build(self.mem, self.layout, src, self.me)
        return lane

    def _recv_steps(self, op: Op, out: np.ndarray):
        lane = self._recv_lane(op.peer)
        received = expected_chunk = publications = 0
        total = landing = None
        while total is None or received < total:
            # Step 5 (Fig. 4): poll our metadata until the sender's next record is published.
            seq = self._consumed.get(lane.src, 0) + 1
            record = lane.records[seq % RECORDS_PER_PAIR]
            while not record.has_rung(seq):
                yield ("record {} from rank {}", seq, lane.src)
            # P2P_RECORD's fields in order (p2p_lanes.P2P_FIELDS).
            fields = record.read("receive", op.event_id, f"publication {seq}")
            _, _, chunk_id, tail, vtime_ns, msg_bytes, nbytes, num_cores, is_dma, kind = fields
            self._check_record(
                op, chunk_id, msg_bytes, expected_chunk, out.nbytes if total is None else None
            )
            total = msg_bytes
            if kind == P2P_RTS:  # a rendezvous (xccl/p2p/send.py): answer where to land
                offset = window_offset(self.mem, out, self.layout.window_bytes(self.me))
                landing = (seq, NO_LANDING if offset is None else offset, out.nbytes)
                self._consumed[lane.src] = seq
                lane.acknowledge(records.ack_word(seq, self.times.clock.now_ns), landing)
                continue
            if self.fault_hook is not None and received + nbytes >= total:
                # The last publication arrived; the sender waits for its ack.
                self.fault_hook("p2p_recv", op.event_id)
            if kind == P2P_DIRECT:  # the bytes are in `out` already; no ring slots were used
                self._check_direct(op, landing, tail)
            else:
                # Step 6: copy the slots out of the managed area into the caller's buffer.
                self._copy_slots(lane, op, out, received, nbytes, tail)
            self._consumed[lane.src] = seq
            self.times.publication_lands(
                lane.src, vtime_ns, nbytes, num_cores=num_cores, is_dma=bool(is_dma)
            )
            # Step 7: acknowledge in the sender's metadata (frees those slots for the next fill).
            lane.acknowledge(records.ack_word(seq, self.times.clock.now_ns))
            received += nbytes
            expected_chunk += -(-nbytes // self.layout.slot_bytes)
            publications += 1
        return Transfer(
            peer=op.peer,
            event_id=op.event_id,
            nbytes=total,
            num_publications=publications,
            vtime_ns=self.times.clock.now_ns,
            direct=kind == P2P_DIRECT,
        )

    def _check_direct(self, op: Op, landing: tuple | None, tail: int) -> None:
        """A direct publication must answer the landing we offered, and leave the tail."""
        rtail = self._rtail.get(op.peer, 0)
        if landing is None or landing[1] == NO_LANDING or tail != rtail:
            raise XcclError(
                f"die rank {self.me}: direct publication from rank {op.peer} (tail {tail}) "
                f"without a landing offered (ours: {landing}, tail {rtail}; event {op.event_id})"
            )

    def _copy_slots(
        self, lane: RecvLane, op: Op, out: np.ndarray, received: int, nbytes: int, tail: int
    ) -> None:
        """Copy a publication's ring slots into out[received:]; its tail must match ours."""
        src, layout, ring = lane.src, self.layout, lane.ring
        rtail = self._rtail.get(src, 0)
        for ring_pos, msg_pos, length in layout.slot_runs(rtail, nbytes):
            at = received + msg_pos
            out[at : at + length] = ring[ring_pos : ring_pos + length]
        rtail = self._rtail[src] = rtail + -(-nbytes // layout.slot_bytes)
        if tail != rtail:
            raise XcclError(
                f"die rank {self.me}: tail pointer from rank {src} is {tail}, "
                f"expected {rtail} (event {op.event_id})"
            )

    def _check_record(
        self, op: Op, chunk_id: int, msg_bytes: int, expected_chunk: int, capacity: int | None
    ) -> None:
        me, src = self.me, op.peer
        if chunk_id != expected_chunk:
            raise XcclError(
                f"die rank {me}: chunk id {chunk_id} from rank {src}, "
                f"expected {expected_chunk} (event {op.event_id})"
            )
        if capacity is not None and msg_bytes > capacity:
            raise BufferTooSmall(
                f"die rank {me}: receive buffer of {capacity} B < the "
                f"{msg_bytes} B message from rank {src} (event {op.event_id})"
            )
