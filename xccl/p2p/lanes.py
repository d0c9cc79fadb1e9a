"""One end of a p2p pair (xccl/p2p/channel.py), settled once when the pair is first used.

Every message on a pair writes the same ring, the same RECORDS_PER_PAIR records and the same ack
word, so the offsets (xccl/layout.py), the bounds checks and the choice of path
(xccl/gmem_paths.py) are made here once, not per message. On the load/store path a lane holds
numpy views of the peer's memory and a message is a few plain stores; on RMA the same methods
call put / store_word. The ordering rules are DieMemory's and xccl/records/slots.py's.

The ack word's record-sized slot also carries the receiver's landing for a rendezvous
(xccl/p2p/send.py): three words after the ack, [publication number, window offset or NO_LANDING,
capacity], written before the ack that makes them visible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from xccl.errors import XcclError
from xccl.gmem import WORD, DieMemory
from xccl.layout import RECORDS_PER_PAIR, P2PLayout
from xccl.records.record import P2P_RECORD, RecordAt
from xccl.records.slots import InRecord, OutRecord

# The order InRecord.read returns a P2P_RECORD's fields in (p2p_recv.py unpacks it).
P2P_FIELDS = (
    "doorbell",
    "event_id",
    "chunk_id",
    "tail",
    "vtime_ns",
    "msg_bytes",
    "pub_bytes",
    "num_cores",
    "is_dma",
    "kind",
)
assert P2P_RECORD.names == P2P_FIELDS, P2P_RECORD.names
# A landing's offset when the receive buffer is not window memory: the message takes the ring.
NO_LANDING = (1 << 64) - 1
LANDING_WORDS = 3  # after the ack word: publication number, offset, capacity


def window_offset(mem: DieMemory, out: np.ndarray, after: int) -> int | None:
    """Where the bytes of `out` (uint8, contiguous) sit in this die's window, if they are window
    memory at or past byte `after` (the p2p area ends there); else None."""
    local = mem.local
    if out.nbytes == 0 or local is None or local.nbytes == 0:
        return None
    offset = out.__array_interface__["data"][0] - local.__array_interface__["data"][0]
    return offset if after <= offset and offset + out.nbytes <= local.nbytes else None


@dataclass(frozen=True)
class SendLane:
    """This die's end of the pair me -> dst.

    ring: dst's ring bytes [ring_slots x slot_bytes] uint8 for plain stores, or None (RMA, at
    ring_offset in dst's window). records: the pair's records in dst's window, publication
    number % RECORDS_PER_PAIR. load_ack: loads the ack word dst writes into our window;
    landing: the LANDING_WORDS after it (our memory).
    """

    mem: DieMemory
    dst: int
    ring_offset: int
    ring: np.ndarray | None
    records: tuple[OutRecord, ...]
    load_ack: Callable[[], int]
    landing: np.ndarray

    @classmethod
    def build(cls, mem: DieMemory, layout: P2PLayout, me: int, dst: int) -> SendLane:
        ring_offset = layout.ring_offset(me, dst)
        return cls(
            mem=mem,
            dst=dst,
            ring_offset=ring_offset,
            ring=mem.region(dst, ring_offset, layout.ring_bytes),
            records=tuple(
                OutRecord(mem, RecordAt(dst, layout.record_offset(me, dst, seq)), P2P_RECORD)
                for seq in range(RECORDS_PER_PAIR)
            ),
            load_ack=mem.word_loader(layout.ack_offset(me, dst), dst),
            landing=_landing_words(mem.local, layout.ack_offset(me, dst)),
        )

    def write(self, ring_pos: int, data: np.ndarray) -> None:
        """Write `data` (uint8) at byte `ring_pos` of the ring; complete at the record's flush."""
        if self.ring is not None:
            self.ring[ring_pos : ring_pos + data.nbytes] = data
        else:
            self.mem.put(self.dst, self.ring_offset + ring_pos, data)

    def write_at(self, offset: int, data: np.ndarray) -> None:
        """Write `data` (uint8) at byte `offset` of dst's window (a landing); complete at the
        record's flush."""
        region = self.mem.region(self.dst, offset, data.nbytes)
        if region is not None:
            region[:] = data
        else:
            self.mem.put(self.dst, offset, data)

    def read_landing(self, seq: int) -> tuple[int, int] | None:
        """The landing dst wrote with its ack of publication `seq`: (offset, capacity) in dst's
        window, or None (the ring). Call after that ack was seen."""
        self.mem.sync()  # the landing words, written before the ack, become visible
        got, offset, capacity = (int(word) for word in self.landing)
        if got != seq:
            raise XcclError(
                f"die rank {self.mem.rank}: landing from rank {self.dst} is for publication "
                f"{got}, expected {seq}"
            )
        return None if offset == NO_LANDING else (offset, capacity)


@dataclass(frozen=True)
class RecvLane:
    """This die's end of the pair src -> me.

    ring: our ring bytes [ring_slots x slot_bytes] uint8 that src writes. records: src's records
    in our window, publication number % RECORDS_PER_PAIR. ack: the ack word and the landing
    words after it in src's window [1 + LANDING_WORDS] uint64 for plain stores, or None (RMA, at
    ack_offset).
    """

    mem: DieMemory
    src: int
    ring: np.ndarray
    records: tuple[InRecord, ...]
    ack_offset: int
    ack: np.ndarray | None

    @classmethod
    def build(cls, mem: DieMemory, layout: P2PLayout, src: int, me: int) -> RecvLane:
        ring_offset, ack_offset = layout.ring_offset(src, me), layout.ack_offset(src, me)
        mem.check(me, ring_offset, layout.ring_bytes, "ring")
        ack = mem.region(src, ack_offset, (1 + LANDING_WORDS) * WORD.itemsize)
        return cls(
            mem=mem,
            src=src,
            ring=mem.local[ring_offset : ring_offset + layout.ring_bytes],
            records=tuple(
                InRecord(mem, RecordAt(src, layout.record_offset(src, me, seq)), P2P_RECORD)
                for seq in range(RECORDS_PER_PAIR)
            ),
            ack_offset=ack_offset,
            ack=None if ack is None else ack.view(WORD),
        )

    def acknowledge(self, word: int, landing: tuple[int, int, int] | None = None) -> None:
        """Write the ack word into src's window and complete it (records.ack_word); a
        `landing` (publication number, offset, capacity) goes first, ordered before the ack."""
        if self.ack is not None:
            if landing is not None:
                self.ack[1:] = landing
                self.mem.sync()
            self.ack[0] = word  # one aligned 8-byte store: atomic
            self.mem.sync()
            return
        if landing is not None:
            self.mem.put(self.src, self.ack_offset + WORD.itemsize, np.array(landing, WORD))
            self.mem.flush(self.src)
        self.mem.store_word(self.src, self.ack_offset, word)
        self.mem.flush(self.src)


def _landing_words(local: np.ndarray, ack_offset: int) -> np.ndarray:
    start = ack_offset + WORD.itemsize
    return local[start : start + LANDING_WORDS * WORD.itemsize].view(WORD)
