"""The receiving end of a p2p ring (xDeepServe §3.1, Figure 4, steps 5-7), part of xccl/p2p.py P2P.

A receive polls its metadata for the sender's next record, checks it (chunk id, tail pointer,
message size against the caller's buffer), copies the publication's slots out of the ring and
acknowledges in the sender's metadata, until the whole message arrived. P2P mixes this in: it owns
the window, the layout, the virtual times, the fault hook and the per-source counters advanced
here (the restart rule in xccl/p2p.py moves them).
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from xccl import records
from xccl.errors import BufferTooSmall, XcclError
from xccl.faults import FaultHook
from xccl.gmem import DieMemory
from xccl.layout import P2PLayout
from xccl.p2p_ops import Op, Transfer
from xccl.p2p_time import P2PTimes
from xccl.records import P2P_RECORD, Expected, RecordAt


class RingReceiver:
    """Receive steps of P2P; the attributes below are P2P's."""

    mem: DieMemory
    layout: P2PLayout
    me: int
    times: P2PTimes
    fault_hook: FaultHook | None
    _consumed: dict[int, int]  # src -> publications consumed
    _rtail: dict[int, int]  # src -> slots consumed

    def _recv_steps(self, op: Op, out: np.ndarray):
        received = expected_chunk = publications = 0
        total = None
        while total is None or received < total:
            # Step 5 (Fig. 4): poll our metadata until the sender's next record is published.
            seq, body = yield from self._next_record(op)
            self._check_record(op, body, expected_chunk, out.nbytes if total is None else None)
            total, nbytes = int(body["msg_bytes"]), int(body["pub_bytes"])
            if self.fault_hook is not None and received + nbytes >= total:
                # The last publication arrived; the sender waits for its ack.
                self.fault_hook("p2p_recv", op.event_id)
            # Step 6-7: copy the slots out, then acknowledge (_consume).
            self._consume(op, out, received, seq, body)
            received += nbytes
            expected_chunk += -(-nbytes // self.layout.slot_bytes)
            publications += 1
        return Transfer(
            peer=op.peer,
            event_id=op.event_id,
            nbytes=total,
            num_publications=publications,
            vtime_ns=self.times.clock.now_ns,
        )

    def _next_record(self, op: Op) -> Generator[str, None, tuple[int, np.void]]:
        """Yields while the sender's next record is unpublished; returns (its number, its body)."""
        src = op.peer
        seq = self._consumed.get(src, 0) + 1
        source = [RecordAt(src, self.layout.record_offset(src, self.me, seq))]
        while records.missing_peers(self.mem, source, seq):
            yield f"record {seq} from rank {src}"
        expected = Expected(
            stage="receive", event_id=op.event_id, doorbell=seq, call=f"publication {seq}"
        )
        return seq, records.read(self.mem, source, expected, P2P_RECORD)[0]

    def _consume(self, op: Op, out: np.ndarray, received: int, seq: int, body: np.void) -> None:
        """Take publication `seq` (record `body`) into out[received:] and acknowledge it."""
        src, nbytes = op.peer, int(body["pub_bytes"])
        # Step 6: copy the slots out of the managed area into the caller's buffer.
        self._copy_slots(op, out, received, nbytes, int(body["tail"]))
        self._consumed[src] = seq
        self.times.publication_lands(
            src,
            float(body["vtime_ns"]),
            nbytes,
            num_cores=int(body["num_cores"]),
            is_dma=bool(body["is_dma"]),
        )
        # Step 7: acknowledge in the sender's metadata (frees those slots for the next fill).
        ack = self.layout.ack_offset(src, self.me)
        self.mem.store_word(src, ack, records.ack_word(seq, self.times.clock.now_ns))
        self.mem.flush(src)

    def _copy_slots(self, op: Op, out: np.ndarray, received: int, nbytes: int, tail: int) -> None:
        """Copy a publication's ring slots into out[received:]; its tail must match ours."""
        src, layout, local = op.peer, self.layout, self.mem.local
        ring, rtail = layout.ring_offset(src, self.me), self._rtail.get(src, 0)
        for ring_pos, msg_pos, length in layout.slot_runs(rtail, nbytes):
            at = received + msg_pos
            out[at : at + length] = local[ring + ring_pos : ring + ring_pos + length]
        rtail = self._rtail[src] = rtail + -(-nbytes // layout.slot_bytes)
        if tail != rtail:
            raise XcclError(
                f"die rank {self.me}: tail pointer from rank {src} is {tail}, "
                f"expected {rtail} (event {op.event_id})"
            )

    def _check_record(
        self, op: Op, body: np.void, expected_chunk: int, capacity: int | None
    ) -> None:
        me, src, msg_bytes = self.me, op.peer, int(body["msg_bytes"])
        if int(body["chunk_id"]) != expected_chunk:
            raise XcclError(
                f"die rank {me}: chunk id {int(body['chunk_id'])} from rank {src}, "
                f"expected {expected_chunk} (event {op.event_id})"
            )
        if capacity is not None and msg_bytes > capacity:
            raise BufferTooSmall(
                f"die rank {me}: receive buffer of {capacity} B < the "
                f"{msg_bytes} B message from rank {src} (event {op.event_id})"
            )
