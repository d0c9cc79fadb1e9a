"""DieMemory's two paths (load/store and RMA) and their ordering rules, under torture.

Run by tests/e2e/bodies/test_mpi_bodies.py under the default path and with XDS_MEMORY_PATH=rma;
each test here also builds its windows with both paths explicitly.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from xccl import gmem_paths, records
from xccl.gmem import DieMemory
from xccl.gmem_paths import LOAD_STORE
from xccl.records import ROWS_RECORD, Expected, RecordAt
from xccl.wake import poll_until

comm = MPI.COMM_WORLD
MESSAGES, SLOTS, DATA_WORDS = 600, 3, 512
RECORD = 64


@pytest.fixture(params=["auto", "rma"])
def mem(request):
    """Per peer: SLOTS record + data slots written by that peer, and one ack word."""
    size = comm.size * (SLOTS * (RECORD + DATA_WORDS * 8) + 8)
    window = DieMemory(comm, size, memory_path=request.param)
    yield window
    comm.Barrier()
    window.free()


def test_paths_chosen_at_creation(mem):
    """'rma' reaches no peer by load/store; 'auto' every peer of this node when the MPI exposes
    a peer's memory for Allocate windows (MPICH does, docs/mpi.md §2), else RMA to every one."""
    everyone = list(range(comm.size))
    if mem.memory_path == "rma":
        assert all(v is None for v in mem.views), mem.describe_paths()
    elif "MPICH" in MPI.Get_library_version():
        assert all(v is not None for v in mem.views), mem.describe_paths()
        assert mem.describe_paths() == f"{LOAD_STORE} to ranks {everyone}"
    else:  # e.g. Open MPI's default: no shared buffer, so the fallback for every peer
        views = {v is None for v in mem.views}
        assert len(views) == 1, mem.describe_paths()


def slot_at(writer: int, seq: int) -> tuple[int, int]:
    """(record offset, data offset) of publication `seq` from `writer` in a reader's window."""
    base = writer * (SLOTS * (RECORD + DATA_WORDS * 8) + 8) + (seq % SLOTS) * (
        RECORD + DATA_WORDS * 8
    )
    return base, base + RECORD


def ack_at(reader: int) -> int:
    """Offset in a writer's window of the ack word `reader` writes."""
    return reader * (SLOTS * (RECORD + DATA_WORDS * 8) + 8) + SLOTS * (RECORD + DATA_WORDS * 8)


def test_torture_every_message_whole(mem):
    """Every rank streams MESSAGES publications to the next rank (data, flush, doorbell) with at
    most SLOTS unacknowledged; the reader checks every data word carries the sequence number,
    so a doorbell seen before its data (a broken ordering rule) fails."""
    dst, src = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    deadline = time.monotonic() + 60
    sent = received = 0
    while received < MESSAGES or sent < MESSAGES:
        if sent < MESSAGES and sent - mem.load_word(ack_at(dst), dst) < SLOTS:
            seq = sent + 1
            record, data = slot_at(comm.rank, seq)
            mem.put(dst, data, np.full(DATA_WORDS, seq, np.uint64))
            body = np.zeros(1, ROWS_RECORD)
            body["event_id"], body["count"] = seq, seq
            records.publish(mem, [RecordAt(dst, record)], body, seq)
            sent = seq
        if received < MESSAGES:
            seq = received + 1
            record, data = slot_at(src, seq)
            expected = Expected(stage="torture", event_id=seq, doorbell=seq, call="test")
            got = records.ready(mem, [RecordAt(src, record)], expected, ROWS_RECORD)
            if got is not None:
                words = mem.words[data // 8 : data // 8 + DATA_WORDS]
                assert int(got["count"][0]) == seq and (words == seq).all(), (seq, words[:4])
                received = seq
                mem.store_word(src, ack_at(comm.rank), seq)
                mem.flush(src)
        assert time.monotonic() < deadline, f"rank {comm.rank}: stuck at {sent}/{received}"


def test_get_and_fetch_see_a_peers_stores(mem):
    """A peer's stored data and word are read back by get / fetch_word after a barrier."""
    peer = (comm.rank + 1) % comm.size
    _, data = slot_at(comm.rank, 0)
    mem.put(peer, data, np.arange(DATA_WORDS, dtype=np.uint64) + comm.rank)
    mem.store_word(peer, ack_at(comm.rank), 1000 + comm.rank)
    mem.flush_all()
    comm.Barrier()
    writer = (comm.rank - 1) % comm.size
    _, theirs = slot_at(writer, 0)
    out = np.zeros(DATA_WORDS, np.uint64)
    mem.get(comm.rank, theirs, out)
    mem.flush(comm.rank)
    assert (out == np.arange(DATA_WORDS, dtype=np.uint64) + writer).all()
    assert mem.fetch_word(comm.rank, ack_at(writer)) == 1000 + writer
    poll_until(
        lambda: mem.load_word(ack_at(writer), writer) == 1000 + writer,
        deadline=time.monotonic() + 10,
        describe=lambda: "ack word",
    )


def _no_node_split(comm):
    raise AssertionError("a window made a node split although every rank's node was known")


@pytest.mark.parametrize("memory_path", ["auto", "rma"])
def test_a_window_learns_its_peers_nodes_from_the_known_leaders(monkeypatch, memory_path):
    """With every rank's node leader known (launch/job/rank.py: set_node_leader) a window takes its
    peers' nodes from its one allgather, without a node split. Here the ranks pretend to sit two
    to a node (within their real node: a pretended node never spans two), so a wrong table
    shows: load/store to the partner only, RMA to the rest, and a word written by every rank
    still reaches every other one."""
    real = gmem_paths.same_node_table(comm, [None] * comm.size)
    pretended = gmem_paths.node_leader(comm) * comm.size + comm.rank // 2
    monkeypatch.setattr(gmem_paths, "_world_node_leader", pretended)
    monkeypatch.setattr(gmem_paths, "node_leader", _no_node_split)
    window = DieMemory(comm, 8 * comm.size, memory_path=memory_path)
    expected = tuple(real[peer] and peer // 2 == comm.rank // 2 for peer in range(comm.size))
    assert window.is_same_node == expected
    if memory_path == "auto" and "MPICH" in MPI.Get_library_version():
        assert tuple(v is not None for v in window.views) == expected, window.describe_paths()
    for peer in range(comm.size):
        window.store_word(peer, 8 * comm.rank, 100 + comm.rank)
    window.flush_all()
    comm.Barrier()
    for writer in range(comm.size):
        assert window.load_word(8 * writer, writer) == 100 + writer
    comm.Barrier()
    window.free()


def test_a_rank_that_knows_no_node_makes_every_rank_split(monkeypatch):
    """One rank without a known node leader (rank 1; e.g. a process that did not start through
    launch/job/rank.py): all ranks fall back to the node split alike, none waits for the others."""
    leader = gmem_paths.node_leader(comm)
    known = None if comm.rank == 1 else leader
    monkeypatch.setattr(gmem_paths, "_world_node_leader", known)
    window = DieMemory(comm, 8)
    assert window.is_same_node == tuple(gmem_paths.same_node_table(comm, [None] * comm.size))
    comm.Barrier()
    window.free()
