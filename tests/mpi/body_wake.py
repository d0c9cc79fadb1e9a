"""Sleeping waits (xccl/wake.py): the writer a waiter names wakes it; the last die to arrive at
a meeting wakes every sleeper; the records, the dispatch/combine meetings and the agreement still
deliver every round when every wait sleeps."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from xccl import records, wake
from xccl.agreement import WindowAgreement
from xccl.errors import XcclTimeout
from xccl.gmem import DieMemory
from xccl.moe_layout import EpLayout
from xccl.records import ROWS_RECORD, Expected, RecordAt
from xccl.wake import poll_until

comm = MPI.COMM_WORLD
ROUNDS = 200


@pytest.fixture
def sleeping_mem():
    """A window whose waits sleep on every same-node writer (xccl.wait: sleep)."""
    mem = DieMemory(comm, 4096)
    mem.wake_words.sleeps = wake.futex_available()
    yield mem
    comm.Barrier()
    mem.free()


def test_the_named_writer_wakes_a_sleeper_long_before_its_sleep_ends(sleeping_mem, monkeypatch):
    """Rank 0 sleeps naming rank 1, which rings 0.3 s later. With each sleep 30 s long, only
    the wake can end the wait in time: a lost or misdirected wake would take 30 s."""
    mem = sleeping_mem
    if not wake.futex_available():
        pytest.skip("no futex on this platform: waits spin")
    monkeypatch.setattr(wake, "PARK_S", 30.0)
    comm.Barrier()
    if comm.rank == 1:
        time.sleep(0.3)
        mem.store_word(0, 0, 7)
        mem.flush(0)
        mem.wake_words.wake([0])
    elif comm.rank == 0:

        def rang() -> bool:
            return mem.load_word(0, 1) == 7

        start = time.monotonic()
        poll_until(
            rang,
            deadline=start + 60,
            describe=lambda: "rank 0: no word from rank 1",
            park=mem.wake_words.sleeper([1], rang, lambda: [1]),
        )
        assert time.monotonic() - start < 10


def test_the_last_to_arrive_wakes_every_sleeper_of_a_meeting(sleeping_mem, monkeypatch):
    """Meetings of every rank (the records of dispatch/combine: each die's record in every
    die's window), one rank 0.2 s late each round. With each sleep 30 s long, only the last
    arrival's wake ends the others' waits in time: a lost wake would take 30 s."""
    mem = sleeping_mem
    if not wake.futex_available():
        pytest.skip("no futex on this platform: waits spin")
    monkeypatch.setattr(wake, "MEETING_PARK_S", 30.0)
    me, size = comm.rank, comm.size
    meeting = mem.wake_words.meeting(range(size))
    if mem.views[0] is None:  # the RMA path: the wake words are out of reach, the waits spin
        assert meeting is None
        return
    assert meeting is not None, "one node, every rank may sleep: the meeting must sleep"
    at = lambda writer: RecordAt(writer, writer * records.RECORD_BYTES)  # noqa: E731
    fan_out = records.FanOut.records(
        mem, [RecordAt(peer, me * records.RECORD_BYTES) for peer in range(size)], ROWS_RECORD,
        wakes=False,
    )  # fmt: skip
    fan_in = records.FanIn(mem, [at(w) for w in range(size)], ROWS_RECORD, meeting=meeting)
    for round_ in range(1, 4):
        comm.Barrier()
        if me == round_ % size:
            time.sleep(0.2)  # the others are asleep when this one rings
        start = time.monotonic()
        bodies = np.zeros(size, ROWS_RECORD)
        bodies["event_id"], bodies["count"] = round_, me
        fan_out.publish(bodies.view(np.uint8).reshape(size, -1), round_)
        expected = Expected(stage="test", event_id=round_, doorbell=round_, call=f"round {round_}")
        got = fan_in.wait(expected, timeout_s=60, interrupt=None)
        assert time.monotonic() - start < 10, f"round {round_}: woken by the sleep's end"
        assert got["count"].tolist() == list(range(size))
    comm.Barrier()


def test_records_deliver_every_round_while_every_wait_sleeps(sleeping_mem):
    """All-to-all records for ROUNDS rounds, every reader asleep between doorbells: each round's
    bodies carry that round's event and counts (a stale or lost record would show)."""
    mem = sleeping_mem
    me, size = comm.rank, comm.size
    offset = lambda writer: writer * records.RECORD_BYTES  # noqa: E731 - writer's record in a window
    targets = [RecordAt(peer, offset(me)) for peer in range(size)]
    sources = [RecordAt(writer, offset(writer)) for writer in range(size)]
    for round_ in range(1, ROUNDS + 1):
        if (me + round_) % size == 0:
            time.sleep(0.002)  # someone is late every round: the others sleep
        bodies = np.zeros(size, ROWS_RECORD)
        bodies["event_id"], bodies["count"] = round_, [me * 1000 + round_ + p for p in range(size)]
        records.publish(mem, targets, bodies, round_)
        expected = Expected(stage="test", event_id=round_, doorbell=round_, call=f"round {round_}")
        got = records.wait(mem, sources, expected, ROWS_RECORD, timeout_s=60, interrupt=None)
        assert got["count"].tolist() == [w * 1000 + round_ + me for w in range(size)]
        comm.Barrier()  # nobody overwrites a record before every reader took it


def test_the_agreement_agrees_every_round_while_every_wait_sleeps():
    layout = EpLayout(
        members=tuple(range(comm.size)),
        base=(0,) * comm.size,
        hidden=8,
        max_tokens=2,
        num_columns=1,
        itemsize=8,
        use_int8=False,
    )
    mem = DieMemory(comm, layout.area_bytes())
    mem.wake_words.sleeps = wake.futex_available()
    agreement = WindowAgreement(mem, layout, timeout_s=60)
    for round_ in range(1, ROUNDS + 1):
        if (comm.rank + round_) % comm.size == 0:
            time.sleep(0.002)
        rows = agreement.agree((comm.rank * round_, round_ % 3))
        assert rows[:, 0].tolist() == [r * round_ for r in range(comm.size)]
        assert (rows[:, 1] == round_ % 3).all()
    comm.Barrier()
    mem.free()


def test_a_gather_lets_nobody_go_before_the_last_arrives_and_wakes_them_at_once(
    sleeping_mem, monkeypatch
):
    """WakeWords.gather, the window frees' barrier: one rank 0.3 s late each round (rank 0, the
    one that releases, among them). Nobody leaves before the late one arrived, and with each
    sleep 30 s long only the wakes end the waits in time: a lost wake would take 30 s."""
    mem = sleeping_mem
    words = mem.wake_words
    if not words.reach_every_rank:  # spin, or another node
        assert not words.gather(what="test", timeout_s=5)
        return
    monkeypatch.setattr(wake, "_GATHER_PARK", wake._Timespec(30, 0))
    for round_ in range(comm.size):
        comm.Barrier()
        late = comm.rank == round_
        if late:
            time.sleep(0.3)
        arrived = time.time()
        assert words.gather(what=f"round {round_}", timeout_s=60)
        left = time.time()
        arrivals = comm.allgather(arrived)
        assert left >= max(arrivals), f"round {round_}: left before rank {round_} arrived"
        assert left - max(arrivals) < 10, f"round {round_}: woken by the sleep's end"
    comm.Barrier()


def test_a_gather_names_the_ranks_that_never_came(sleeping_mem):
    """Rank 0 waits for a rank that does not come: a bounded wait naming it, not a hang."""
    mem = sleeping_mem
    words = mem.wake_words
    if not words.reach_every_rank or comm.size < 2:
        pytest.skip("the gather needs every rank's words on this node")
    comm.Barrier()
    absent = comm.size - 1
    if comm.rank == 0:
        with pytest.raises(XcclTimeout, match=rf"ranks \[{absent}\] did not arrive"):
            words.gather(what="test", timeout_s=0.5)
    elif comm.rank != absent:
        with pytest.raises(XcclTimeout, match="rank 0 has not seen every rank arrive"):
            words.gather(what="test", timeout_s=1.5)
    else:
        words._gathers += 1  # counted as if it came: the window's free gathers them all again
    comm.Barrier()


def test_a_window_without_wake_words_meets_on_a_live_ones_over_the_same_ranks(sleeping_mem):
    """The abort words' window (wakes=False) frees after a gather on the data window's words
    when both span the same ranks in the same order; over other ranks it keeps the dozing
    barrier. Either way every rank decides alike and the frees return."""
    words = sleeping_mem.wake_words
    reachable = words.reach_every_rank
    same = DieMemory(comm, 16, wakes=False)
    assert same.wake_words.win is None
    assert (same._meets_on is sleeping_mem) == reachable
    reordered_comm = comm.Split(0, comm.size - comm.rank)  # the same ranks, reversed
    reordered = DieMemory(reordered_comm, 16, wakes=False)
    assert reordered._meets_on is None or comm.size == 1
    reordered.free()
    same.free()
    reordered_comm.Free()
