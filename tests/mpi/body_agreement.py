"""The dies' one-sided agreement between iterations (xccl/agreement.py) on both memory paths."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from xccl.agreement import WindowAgreement
from xccl.errors import XcclTimeout
from xccl.gmem import DieMemory
from xccl.moe_layout import AGREE_WORDS, EpLayout

comm = MPI.COMM_WORLD
ROUNDS = 300


class Stop(Exception):
    pass


@pytest.fixture(params=["auto", "rma"])
def agreement(request):
    layout = EpLayout(
        members=tuple(range(comm.size)),
        base=(0,) * comm.size,
        hidden=8,
        max_tokens=2,
        num_columns=1,
        itemsize=8,
        use_int8=False,
    )
    mem = DieMemory(comm, layout.area_bytes(), memory_path=request.param)
    yield lambda timeout_s: WindowAgreement(mem, layout, timeout_s=timeout_s)
    comm.Barrier()
    mem.free()


def values(rank: int, round_: int) -> tuple[int, ...]:
    words = (rank * round_, (rank + round_) % 2, 1000 + rank, round_ % 7, 3 * rank + round_)
    words += (1 << 40,)  # a word above 32 bits
    assert len(words) >= AGREE_WORDS  # every word the agreement carries, written and read back
    return words[:AGREE_WORDS]


def test_every_member_sees_every_members_values_of_the_round(agreement):
    """Rounds back to back, members out of step (one sleeps now and then, so the fastest writes
    round r + 1 while a slow one still reads round r): every member reads, each round, exactly
    what each member wrote in it — a bank overwritten too early or a doorbell seen before its
    payload would show as another round's values."""
    agree = agreement(30.0)
    for r in range(1, ROUNDS + 1):
        if r % (comm.size + 3) == comm.rank:
            time.sleep(0.002)
        rows = agree.agree(values(comm.rank, r))
        expected = np.array([values(p, r) for p in range(comm.size)], np.int64)
        np.testing.assert_array_equal(rows, expected, err_msg=f"round {r}")


def test_a_silent_member_is_named_after_the_timeout(agreement):
    """The last rank never agrees: every other one raises XcclTimeout naming it and the round,
    after the round's own bound (a die's vote timeout may differ from the window's)."""
    agree = agreement(30.0)
    silent = comm.size - 1
    if comm.rank != silent:
        missing = rf"round 1: no word from rank\(s\) \[{silent}\] after 0.5 s"
        with pytest.raises(XcclTimeout, match=missing):
            agree.agree(values(comm.rank, 1), timeout_s=0.5)


def test_the_interrupt_is_called_while_waiting(agreement):
    """A die waiting for a silent member is left by its interrupt (the TE-shell's fence)."""
    agree = agreement(30.0)
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    if comm.rank != comm.size - 1:
        with pytest.raises(Stop):
            agree.agree(values(comm.rank, 1), interrupt=interrupt)
