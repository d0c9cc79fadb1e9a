"""A prefill TP group's all-gather and all-to-all by one-sided writes (xccl/tp_gather.py), on
both memory paths: every member gets every member's piece (for it) of the call, the virtual time
the peers stamped, and a silent member named after the bounded wait."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from xccl.errors import PeerTimeout
from xccl.gmem import DieMemory
from xccl.tp_gather import TpGather, TpLayout
from xccl.vclock import VirtualClock

comm = MPI.COMM_WORLD
ROUNDS = 100
MAX_ROWS, WIDTH = 5, 3


@pytest.fixture(params=["auto", "rma"])
def gather(request):
    layout = TpLayout(
        members=tuple(range(comm.size)), base=(0,) * comm.size, slot_bytes=MAX_ROWS * WIDTH * 8
    )
    mem = DieMemory(comm, layout.area_bytes(), memory_path=request.param)
    clock = VirtualClock()
    yield lambda timeout_s: TpGather(mem, layout, clock=clock, timeout_s=timeout_s)
    comm.Barrier()
    mem.free()


def piece(rank: int, round_: int) -> np.ndarray:
    """[rows, WIDTH]: every value names its writer, the round and its place."""
    rows = (rank + round_) % MAX_ROWS  # 0 rows too
    return (rank * 1e6 + round_ * 100 + np.arange(rows * WIDTH)).reshape(rows, WIDTH)


def test_every_member_gets_every_piece_of_the_call(gather):
    """Calls back to back, members out of step (one sleeps now and then, so a fast member writes
    call r + 1 while a slow one still reads call r): a slot overwritten before its reader read
    it, or a doorbell seen before its piece, shows as another call's values."""
    tp = gather(30.0)
    for r in range(1, ROUNDS + 1):
        if r % (comm.size + 3) == comm.rank:
            time.sleep(0.002)
        tp.clock.advance(float(comm.rank + 1))
        shapes = [piece(p, r).shape for p in range(comm.size)]
        got = tp.all_gather(piece(comm.rank, r), shapes, event_id=r, what=f"round {r}")
        for p, value in enumerate(got.pieces):
            np.testing.assert_array_equal(value, piece(p, r), err_msg=f"round {r} from {p}")


def test_the_all_to_all_delivers_each_members_piece_for_us(gather):
    """Member p sends member q piece(p * size + q, r): q gets exactly those, call after call,
    gathers and exchanges interleaved as a prefill layer makes them."""
    tp, size = gather(30.0), comm.size
    for r in range(1, ROUNDS // 2 + 1):
        if r % (size + 2) == comm.rank:
            time.sleep(0.002)
        outgoing = [piece(comm.rank * size + q, r) for q in range(size)]
        shapes = [piece(p * size + comm.rank, r).shape for p in range(size)]
        got = tp.exchange(outgoing, shapes, event_id=r, what=f"round {r}")
        for p, value in enumerate(got.pieces):
            np.testing.assert_array_equal(value, piece(p * size + comm.rank, r), err_msg=f"{r}")
        gathered = tp.all_gather(
            piece(comm.rank, r), [piece(p, r).shape for p in range(size)], r, ""
        )
        assert all((g == piece(p, r)).all() for p, g in enumerate(gathered.pieces))


def test_the_peers_stamps_come_back(gather):
    """sent_ns is the latest clock a peer stamped (the gather cannot end before it)."""
    tp = gather(30.0)
    tp.clock.advance(1000.0 * (comm.rank + 1))
    got = tp.all_gather(piece(comm.rank, 1), [piece(p, 1).shape for p in range(comm.size)], 7, "x")
    peers = [p for p in range(comm.size) if p != comm.rank]
    assert got.sent_ns == max(1000.0 * (p + 1) for p in peers)


def test_a_silent_member_is_named_after_the_timeout(gather):
    """The last rank never gathers: every other one raises PeerTimeout naming itself, the
    stage, the event and the silent rank, after the bound."""
    tp = gather(0.5)
    silent = comm.size - 1
    if comm.rank != silent:
        shapes = [piece(p, 1).shape for p in range(comm.size)]
        missing = rf"die rank {comm.rank}: tp gather event 9 .* rank\(s\) \[{silent}\] after 0.5 s"
        with pytest.raises(PeerTimeout, match=missing) as err:
            tp.all_gather(piece(comm.rank, 1), shapes, 9, "attention layer 2")
        assert err.value.peers == (silent,) and err.value.die == comm.rank


def test_a_piece_over_the_slot_is_refused(gather):
    tp = gather(30.0)
    big = np.zeros((MAX_ROWS + 1, WIDTH))
    with pytest.raises(
        ValueError, match=r"piece \(6, 3\) of 144 B for member 0, expected .* slot_bytes\(120\)"
    ):
        tp.all_gather(big, [big.shape] * comm.size, 1, "MoE layer 1")
