"""XCCL p2p's rendezvous (xccl/p2p/send.py) at any rank count (run by
tests/e2e/bodies/test_mpi_bodies.py): a message larger than one publication, received into
window memory, lands with one copy."""

from __future__ import annotations

import numpy as np
import pytest
from body_p2p import LINK, RANKS, SENTINEL, SLOT, SLOTS, comm

from xccl.errors import BufferTooSmall
from xccl.gmem import DieMemory
from xccl.layout import P2PLayout, all_pairs
from xccl.p2p import P2P
from xccl.reference import tagged_payload
from xccl.vclock import VirtualClock


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("memory_path", ["auto", "rma"])
def test_a_large_message_into_window_memory_lands_with_one_copy(memory_path):
    """A message of more than one publication whose receive buffer is window memory is stored
    straight into that buffer (xccl/p2p/send.py): the ring keeps its old bytes, the bytes beside
    the buffer too; a buffer too small is refused before any byte moves; a private buffer still
    takes the ring."""
    nbytes = int(2.5 * SLOTS * SLOT)
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, all_pairs(RANKS))
    base = layout.window_bytes(comm.rank)
    mem = DieMemory(comm, base + nbytes + 16, memory_path=memory_path)
    p2p = P2P(mem, layout, link=LINK, timeout_s=30, server_of=list(RANKS))
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    try:
        mem.local[:] = SENTINEL
        comm.Barrier()
        send = p2p.isend(tagged_payload(comm.rank, right, 0, nbytes), right, event_id=3)
        with pytest.raises(BufferTooSmall, match=rf"receive buffer of {nbytes - 1} B < the"):
            p2p.recv(mem.local[base : base + nbytes - 1], left, event_id=3)
        landing = mem.local[base : base + nbytes]
        got = p2p.recv(landing, left, event_id=3)
        sent = send.wait()
        assert got.direct and sent.direct and got.num_publications == sent.num_publications == 1
        assert (landing == tagged_payload(left, comm.rank, 0, nbytes)).all()
        assert (mem.local[base + nbytes :] == SENTINEL).all()
        ring = layout.ring_offset(left, comm.rank)
        assert (mem.local[ring : ring + layout.ring_bytes] == SENTINEL).all(), "went by the ring"
        comm.Barrier()
        p2p.set_clock(VirtualClock())  # one way, even -> odd rank: priced as one publication
        if comm.rank % 2 == 0 and right % 2:
            p2p.send(tagged_payload(comm.rank, right, 2, nbytes), right, event_id=5)
        elif comm.rank % 2:
            got = p2p.recv(landing, left, event_id=5)
            assert got.direct and got.vtime_ns == pytest.approx(
                LINK.transfer_ns(nbytes, num_cores=2)
            )
        comm.Barrier()
        out = np.zeros(nbytes, np.uint8)
        send = p2p.isend(tagged_payload(comm.rank, right, 1, nbytes), right, event_id=4)
        assert not p2p.recv(out, left, event_id=4).direct and not send.wait().direct
        assert (out == tagged_payload(left, comm.rank, 1, nbytes)).all()
    finally:
        comm.Barrier()
        mem.free()
