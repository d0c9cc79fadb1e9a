"""How a process decides whether its waits sleep (xccl/wake.py; the waits themselves are
tested in tests/mpi/body_wake.py)."""

from __future__ import annotations

import os

import pytest

from xccl import wake


@pytest.fixture(autouse=True)
def _forget_the_decision():
    yield
    wake._sleeps = wake._mode = None


def test_auto_sleeps_only_with_more_ranks_than_cores():
    if not wake.futex_available():
        pytest.skip("no futex here: every mode spins")
    cores = len(os.sched_getaffinity(0))
    assert wake.set_wait_mode("auto", local_ranks=cores + 1) is True
    assert wake.set_wait_mode("auto", local_ranks=cores) is False
    assert wake.set_wait_mode("sleep", local_ranks=1) is True
    assert wake.set_wait_mode("spin", local_ranks=cores + 100) is False
    assert wake.sleeps() is False  # the decision stays for the process


def test_without_a_decision_the_environment_decides(monkeypatch):
    if not wake.futex_available():
        pytest.skip("no futex here: every mode spins")
    monkeypatch.setenv(wake.WAIT_ENV, "sleep")
    assert wake.sleeps() is True
    monkeypatch.setenv(wake.WAIT_ENV, "spin")
    assert wake.sleeps() is False


@pytest.mark.parametrize("mode", ["spin", "auto", "sleep"])
def test_wake_words_only_where_some_rank_may_sleep(mode):
    """xccl.wait "spin": no rank sleeps, so none makes the wake words'
    window (a collective per DieMemory) or stores into a peer's word after each doorbell."""
    from mpi4py import MPI

    wake.set_wait_mode(mode, local_ranks=1)
    words = wake.WakeWords(MPI.COMM_SELF, lambda win, sizes: (None,) * len(sizes))
    try:
        made = words.win is not None
        assert made is (wake.futex_available() and mode != "spin")
        assert wake.nobody_sleeps() is not made
        words.wake([0])  # one rank: nobody to wake either way
        assert words.sleeper([0], lambda: True, lambda: [0]) is None
    finally:
        words.free()
    assert words.win is None


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"xccl.wait must be one of \['auto', 'sleep', 'spin'\]"):
        wake.set_wait_mode("nap", local_ranks=1)


def test_a_doze_sleeps_longer_the_more_ranks_share_a_core(monkeypatch):
    from xccl.wake import Doze, doze_cap_s

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert doze_cap_s(1) == 0.001  # never under 1 ms
    assert doze_cap_s(5) == 0.0005 * 5 / 2  # the main job: 1.25 ms, not 20
    assert doze_cap_s(65) == 0.0005 * 65 / 2
    assert doze_cap_s(289) == Doze.LAST_S  # pod width: 20 ms at most
    monkeypatch.setattr("xccl.wake._doze_cap", None)
    monkeypatch.setenv("MPI_LOCALNRANKS", "9")
    assert Doze().last_s == 0.0005 * 9 / 2  # unset by set_wait_mode: MPI's local rank count


def test_no_wake_words_where_no_wait_sleeps_on_the_window():
    """The abort words' window (xccl/recovery/rollback.py) is polled, never slept on: no wake
    words' window beside it (a collective at start-up), even where waits sleep."""
    from mpi4py import MPI

    from xccl.gmem import DieMemory
    from xccl.recovery.rollback import Recovery

    if not wake.futex_available():
        pytest.skip("no futex here: no rank makes wake words")
    wake.set_wait_mode("sleep", local_ranks=1)
    data, recovery = DieMemory(MPI.COMM_SELF, 64), Recovery(MPI.COMM_SELF, timeout_s=1.0)
    try:
        assert data.wake_words.win is not None
        assert recovery.mem.wake_words.win is None
        assert recovery.mem.wake_words.sleeper([0], lambda: True, lambda: [0]) is None
    finally:
        recovery.free()
        data.free()
