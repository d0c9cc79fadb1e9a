"""The control plane's bounded completion of sends (ranks/core/control.py `wait_all`), on one rank
(COMM_SELF, where a send to oneself completes only once received): a send nobody receives
stands for a peer that never takes its message."""

from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from ranks.core.control import WaitTimeout, wait_all

TAG = 4711


@pytest.fixture
def comm():
    comm = MPI.COMM_SELF.Dup()
    yield comm
    while (message := comm.improbe(source=0, tag=TAG)) is not None:
        message.recv()  # the sends left pending complete before the communicator goes
    comm.Free()


def test_completed_sends_return(comm):
    sends = [comm.isend(("from", 0, i), dest=0, tag=TAG) for i in range(3)]
    taken = [comm.recv(source=0, tag=TAG) for _ in range(3)]
    assert taken == [("from", 0, i) for i in range(3)]
    started = time.monotonic()
    wait_all(sends, timeout_s=5.0, me="rank 0", event="tokens", peers=[0, 0, 0])
    assert time.monotonic() - started < 1.0


def test_a_send_never_taken_times_out_naming_the_peer_and_event(comm):
    taken = comm.isend("taken", dest=0, tag=TAG)
    never = comm.isend("never taken", dest=0, tag=TAG + 1)  # nobody receives tag TAG + 1
    assert comm.recv(source=0, tag=TAG) == "taken"
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as raised:
        wait_all([taken, never], timeout_s=0.3, me="die rank 5", event="heartbeat answers",
                 peers=[3, 7])  # fmt: skip
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 1.5, elapsed
    message = str(raised.value)
    assert message == (
        "die rank 5: heartbeat answers: 1 of 2 not complete after 0.3 s (rank(s) [7])"
    )
    assert comm.recv(source=0, tag=TAG + 1) == "never taken"  # now the send can complete
    wait_all([never], timeout_s=5.0, me="die rank 5", event="heartbeat answers")


def test_without_peers_the_requests_are_named_by_place(comm):
    never = comm.isend("never taken", dest=0, tag=TAG)
    with pytest.raises(WaitTimeout, match=r"TE-shell: stop: 1 of 1 not complete after 0.1 s "
                       r"\(request\(s\) \[0\] of 1\)"):  # fmt: skip
        wait_all([never], timeout_s=0.1, me="TE-shell", event="stop")
    # taken while `never` still holds its buffer: a pending send whose request is gone reads
    # freed memory, and the fixture's clean-up then unpickled garbage now and then
    assert comm.recv(source=0, tag=TAG) == "never taken"
    wait_all([never], timeout_s=5.0, me="TE-shell", event="stop")


def test_peers_must_match_the_requests(comm):
    with pytest.raises(ValueError, match="wait_all: 1 peers for 2 requests"):
        wait_all([MPI.REQUEST_NULL, MPI.REQUEST_NULL], timeout_s=1, me="x", event="y", peers=[1])


def test_no_requests_is_no_wait():
    wait_all([], timeout_s=0.0, me="TE-shell", event="stop")
