"""XCCL point-to-point send/receive at any rank count (run by
tests/e2e/bodies/test_mpi_bodies.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from xccl.errors import BufferTooSmall, EventMismatch, OutOfWindow, UnknownPeer, XcclTimeout
from xccl.gmem import DieMemory
from xccl.layout import P2PLayout, all_pairs
from xccl.p2p import MAX_IN_FLIGHT, P2P
from xccl.reference import p2p_deliveries, tagged_payload
from xccl.vclock import LinkModel, VirtualClock

comm = MPI.COMM_WORLD
RANKS = range(comm.size)
SLOTS, SLOT = 4, 64
SENTINEL = 0xA5
LINK = LinkModel(
    write_gb_per_s_intra=137,
    write_gb_per_s_inter=135,
    write_latency_us_intra=1.3,
    write_latency_us_inter=2.1,
    mte_gb_per_s_per_core=27,
    dma_startup_us=10,
    max_cores=48,
)


@pytest.fixture(params=["auto", "rma"])
def p2p(request):
    """Every ordered pair (self included) has a ring; both polling idioms of gmem are tested:
    "auto" is the local load on one node (and RMA for writers on other nodes), "rma" forces
    Fetch_and_op everywhere."""
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, all_pairs(RANKS))
    mem = DieMemory(comm, layout.window_bytes(comm.rank), poll_idiom=request.param)
    yield P2P(mem, layout, timeout_s=30)
    comm.Barrier()
    mem.free()
    mem.free()  # safe twice


def exchange_all(p2p: P2P, sizes: list[int], **send_args) -> None:
    """Every die sends every size to every die (itself included) at once; check against the
    oracle: bytes, order, sizes, and the sentinel after every receive buffer."""
    sent, handles, received = [], [], {}
    for seq, nbytes in enumerate(sizes):
        for peer in RANKS:
            data = tagged_payload(comm.rank, peer, seq, nbytes)
            sent.append((comm.rank, peer, seq, data.tobytes()))
            handles.append(p2p.isend(data, peer, event_id=seq, **send_args))
            out = np.full(nbytes + 16, SENTINEL, np.uint8)
            received.setdefault(peer, []).append((seq, out))
            handles.append(p2p.irecv(out[:nbytes], peer, event_id=seq))
    results = [h.wait() for h in handles]
    assert all(r.nbytes == sizes[r.event_id] for r in results)
    # The oracle for messages *to* this die: what each source sent it, in order.
    everything = [m for ms in comm.allgather(sent) for m in ms]
    expected = p2p_deliveries(everything)
    for src in RANKS:
        want = expected[(src, comm.rank)]
        got = [(seq, out[: sizes[seq]].tobytes()) for seq, out in received[src]]
        assert got == want, f"rank {comm.rank}: messages from rank {src} differ from the oracle"
        for seq, out in received[src]:
            assert (out[sizes[seq] :] == SENTINEL).all(), f"overrun past message {seq} from {src}"


@pytest.mark.mpi(min_size=2)
def test_every_ordered_pair_at_the_edge_sizes(p2p):
    ring = SLOTS * SLOT
    exchange_all(p2p, [0, 1, SLOT - 1, SLOT, SLOT + 1, 3 * ring + 7])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_cores", [1, 3, 48])
def test_cores_split_a_transfer_without_changing_it(p2p, num_cores):
    exchange_all(p2p, [SLOT * 2 + 5, 1000], num_cores=num_cores)


@pytest.mark.mpi(min_size=2)
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(sizes=st.lists(st.integers(0, 5 * SLOTS * SLOT), min_size=1, max_size=4))
def test_random_sizes_arrive_intact(sizes):
    # derandomize: every rank draws the same examples, so the collective calls stay matched.
    assert comm.allgather(sizes) == [sizes] * comm.size
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, all_pairs(RANKS))
    mem = DieMemory(comm, layout.window_bytes(comm.rank))
    try:
        exchange_all(P2P(mem, layout, timeout_s=30), sizes)
    finally:
        comm.Barrier()
        mem.free()


@pytest.mark.mpi(min_size=2)
def test_sync_sends_around_a_ring_with_flow_control(p2p):
    # Each message is 2.5 rings, so the sender must wait for acks to reuse slots.
    assert MAX_IN_FLIGHT == 2
    nbytes = int(2.5 * SLOTS * SLOT)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = np.full(nbytes + 8, SENTINEL, np.uint8)
    data = tagged_payload(comm.rank, right, 0, nbytes)
    if comm.rank % 2 == 0:
        result = p2p.send(data, right, event_id=11)
        p2p.recv(out[:nbytes], left, event_id=11)
    else:
        p2p.recv(out[:nbytes], left, event_id=11)
        result = p2p.send(data, right, event_id=11)
    assert result.num_publications == 5  # half a ring per publication, two in flight
    assert (out[:nbytes] == tagged_payload(left, comm.rank, 0, nbytes)).all()
    assert (out[nbytes:] == SENTINEL).all()


@pytest.mark.mpi(min_size=2)
def test_async_transfers_progress_while_the_caller_computes(p2p):
    nbytes = 3 * SLOTS * SLOT
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = np.zeros(nbytes, np.uint8)
    send = p2p.isend(tagged_payload(comm.rank, right, 5, nbytes), right, event_id=5)
    recv = p2p.irecv(out, left, event_id=5)
    matrix, checks = np.eye(64), 0
    while not (send.test() and recv.test()):
        matrix = matrix @ matrix  # the caller's own work between checks
        checks += 1
        assert checks < 1_000_000
    assert (out == tagged_payload(left, comm.rank, 5, nbytes)).all()
    assert send.wait().num_publications == recv.wait().num_publications == 6


@pytest.mark.mpi(min_size=2)
def test_wrong_event_and_short_buffer_are_named_and_leave_the_message(p2p):
    if comm.rank == 0:
        p2p.isend(np.arange(100, dtype=np.uint8), 1, event_id=7).wait()
    elif comm.rank == 1:
        with pytest.raises(EventMismatch) as err:
            p2p.recv(np.zeros(100, np.uint8), 0, event_id=8)
        assert str(err.value) == (
            "die rank 1: receive expected event 8, rank 0 reported event 7 (publication 1)"
        )
        with pytest.raises(
            BufferTooSmall,
            match=r"die rank 1: receive buffer of 99 B < the "
            r"100 B message from rank 0 \(event 7\)",
        ):
            p2p.recv(np.zeros(99, np.uint8), 0, event_id=7)
        out = np.zeros(100, np.uint8)
        assert p2p.recv(out, 0, event_id=7).nbytes == 100
        assert (out == np.arange(100)).all()


@pytest.mark.mpi(min_size=2)
def test_unknown_peer_and_undeclared_pair_are_refused_at_the_call():
    ring_pairs = {(r, (r + 1) % comm.size) for r in RANKS}
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, ring_pairs)
    mem = DieMemory(comm, layout.window_bytes(comm.rank))
    p2p = P2P(mem, layout, timeout_s=5)
    try:
        with pytest.raises(
            UnknownPeer,
            match=rf"die rank {comm.rank}: send of 3 B to rank "
            rf"{comm.size + 2}, event 4: rank {comm.size + 2} "
            r"is outside ranks",
        ):
            p2p.isend(np.zeros(3, np.uint8), comm.size + 2, event_id=4)
        left = (comm.rank - 1) % comm.size
        if comm.size > 2:
            with pytest.raises(
                UnknownPeer,
                match=rf"declares no ring for rank {comm.rank} -> "
                rf"rank {left}",
            ):
                p2p.isend(np.zeros(3, np.uint8), left, event_id=4)
    finally:
        comm.Barrier()
        mem.free()


@pytest.mark.mpi(min_size=2)
def test_a_receive_without_sender_ends_at_its_deadline(p2p):
    started = time.monotonic()
    with pytest.raises(XcclTimeout) as err:
        p2p.irecv(np.zeros(8, np.uint8), (comm.rank + 1) % comm.size, event_id=3).wait(0.3)
    assert time.monotonic() - started < 5
    peer = (comm.rank + 1) % comm.size
    assert str(err.value).startswith(
        f"die rank {comm.rank}: recv of 8 B from rank {peer}, "
        "event 3: no progress after 0.3 s, waiting for record 1"
    )


@pytest.mark.mpi(min_size=2)
def test_rma_outside_a_window_is_refused_before_mpi(p2p):
    mem = p2p.mem
    peer = (comm.rank + 1) % comm.size
    with pytest.raises(
        OutOfWindow,
        match=rf"put of 16 B at offset {mem.sizes[peer] - 8} in "
        rf"rank {peer}'s window of {mem.sizes[peer]} B",
    ):
        mem.put(peer, mem.sizes[peer] - 8, np.zeros(16, np.uint8))
    with pytest.raises(OutOfWindow):
        mem.get(peer, -1, np.zeros(1, np.uint8))


@pytest.mark.mpi(min_size=2)
def test_virtual_time_travels_with_the_records():
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, all_pairs(RANKS))
    mem = DieMemory(comm, layout.window_bytes(comm.rank))
    clock = VirtualClock(start_ns=1000.0 * comm.rank)
    p2p = P2P(
        mem,
        layout,
        clock=clock,
        link=LINK,
        num_cores=2,
        timeout_s=30,
        server_of=[r // 2 for r in RANKS],
    )
    try:
        nbytes = SLOT * 3  # one publication
        if comm.rank == 1:
            p2p.send(np.zeros(nbytes, np.uint8), 0, event_id=1)
            ack_time = comm.recv(source=0)
            assert clock.now_ns == ack_time + LINK.latency_ns(same_server=True)
        elif comm.rank == 0:
            p2p.recv(np.zeros(nbytes, np.uint8), 1, event_id=1)
            # Receiver (clock 0) waits for data sent at 1000 ns over an intra-server link.
            assert clock.now_ns == pytest.approx(
                1000.0 + LINK.transfer_ns(nbytes, num_cores=2, same_server=True)
            )
            comm.send(int(clock.now_ns), dest=1)
    finally:
        comm.Barrier()
        mem.free()


@pytest.mark.mpi(min_size=2)
def test_host_ranks_take_part_with_zero_bytes():
    dies = range(1, comm.size)
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, all_pairs(dies))
    assert layout.window_bytes(0) == 0
    mem = DieMemory(comm, layout.window_bytes(comm.rank))
    try:
        if comm.rank != 0:
            exchange = P2P(mem, layout, timeout_s=30)
            peer = 1 + comm.rank % (comm.size - 1)
            src = 1 + (comm.rank - 2) % (comm.size - 1)
            out = np.zeros(50, np.uint8)
            handles = [
                exchange.isend(tagged_payload(comm.rank, peer, 0, 50), peer, 0),
                exchange.irecv(out, src, 0),
            ]
            [h.wait() for h in handles]
            assert (out == tagged_payload(src, comm.rank, 0, 50)).all()
    finally:
        comm.Barrier()
        mem.free()
