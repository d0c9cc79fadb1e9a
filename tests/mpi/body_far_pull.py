"""A die that waits on its own node still serves a far die's pull from its window.

Across nodes a window moves only while its owner is inside MPI (docs/mpi.md). The chain here
is afd_pod's on two hosts, cut to three ranks: A waits for a record from B (B on A's node, so A
polls by local loads or sleeps); B waits for a record from C; C publishes it only after its Get
from A's window has completed. When C is on the other node, C's Flush of that Get needs A
inside MPI; a wait that never steps into MPI leaves all three waiting until A's timeout
(DieMemory.serve_far_peers is what every wait calls to prevent it). On one node, and at two
ranks (where B is C), every step is local and the body passes trivially;
tests/e2e/hosts/test_two_hosts.py runs it with A and B on one host and C on the other.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from xccl import records
from xccl.gmem import DieMemory
from xccl.layout import RECORD_BYTES
from xccl.records import ROWS_RECORD, Expected, RecordAt

comm = MPI.COMM_WORLD
A, C = 0, comm.size - 1
B = 1 if comm.size >= 3 else C
DATA_AT, DATA_WORDS = RECORD_BYTES, 256
TIMEOUT_S = 30.0


@pytest.fixture
def mem():
    window = DieMemory(comm, RECORD_BYTES + DATA_WORDS * 8)
    yield window
    comm.Barrier()
    window.free()


def _publish(mem: DieMemory, to: int, seq: int) -> None:
    body = np.zeros(1, ROWS_RECORD)
    body["event_id"] = seq
    records.publish(mem, [RecordAt(to, 0)], body, seq)


def _wait(mem: DieMemory, writer: int, seq: int) -> None:
    expected = Expected(stage="far pull", event_id=seq, doorbell=seq, call=f"step {seq}")
    records.wait(
        mem, [RecordAt(writer, 0)], expected, ROWS_RECORD, timeout_s=TIMEOUT_S, interrupt=None
    )


def test_a_waiting_die_serves_a_far_pull_from_its_window(mem):
    pattern = np.arange(DATA_WORDS, dtype=np.uint64) + 7
    if comm.rank == A:
        mem.put(A, DATA_AT, pattern)
        mem.flush(A)
    comm.Barrier()
    if comm.rank == C:
        out = np.zeros(DATA_WORDS, np.uint64)
        mem.get(A, DATA_AT, out)
        mem.flush(A)  # completes only while A is inside MPI when A is on the other node
        assert (out == pattern).all(), out[:4]
        _publish(mem, B if B != C else A, 1)
    if comm.rank == B and B != C:
        _wait(mem, C, 1)
        _publish(mem, A, 1)
    if comm.rank == A:
        _wait(mem, B, 1)  # B is on A's node: without serving C, this wait never enters MPI
