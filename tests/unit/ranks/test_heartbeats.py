"""Heartbeats keep one ping in flight per target and one answer per responder turn
(ranks/recovery/watch.py), on one rank (COMM_SELF: the rank pings itself; a send to oneself
completes only once received, as a send to a die that has not taken it yet)."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from ranks.core.control import WaitTimeout
from ranks.core.tags import TAG_HEARTBEAT, TAG_HEARTBEAT_ACK
from ranks.recovery.watch import LAST_SEQ, HeartbeatResponder, HeartbeatSender, Pong


@pytest.fixture
def comm():
    comm = MPI.COMM_SELF.Dup()
    yield comm
    for tag in (TAG_HEARTBEAT, TAG_HEARTBEAT_ACK):
        while (message := comm.improbe(source=0, tag=tag)) is not None:
            message.recv()
    comm.Free()


def pings_queued(comm) -> list[int]:
    """The sequence numbers of the pings waiting for rank 0, taken."""
    seqs = []
    while (message := comm.improbe(source=0, tag=TAG_HEARTBEAT)) is not None:
        seqs.append(message.recv().seq)
    return seqs


def answers_queued(comm) -> list:
    """The answers waiting for rank 0, taken."""
    answers = []
    while (message := comm.improbe(source=0, tag=TAG_HEARTBEAT_ACK)) is not None:
        answers.append(message.recv())
    return answers


def test_a_target_that_has_not_taken_its_ping_gets_no_second_one(comm):
    sender = HeartbeatSender(comm, [0], interval_s=1.0, timeout_s=10)
    for now in (0.0, 1.0, 2.0, 3.0):  # four intervals, the ping never taken
        sender.tick(now)
    assert sender.seq == 4
    assert pings_queued(comm) == [1]
    sender.tick(4.0)  # taken: the next interval sends again
    assert pings_queued(comm) == [5]
    sender.close(timeout_s=5)


def test_a_responder_answers_the_newest_ping_once_a_turn(comm):
    pings = [comm.isend(_ping(seq), dest=0, tag=TAG_HEARTBEAT) for seq in (1, 2, 3)]
    responder = HeartbeatResponder(comm, 0)
    responder.answer("alive")
    responder.answer("alive")  # its answer not taken yet: none more
    pings.append(comm.isend(_ping(4), dest=0, tag=TAG_HEARTBEAT))
    responder.answer("alive")
    assert [(a.seq, a.status) for a in answers_queued(comm)] == [(3, "alive")]
    assert responder.answered == 1
    responder.answer("busy")  # taken: the next turn answers the ping that came meanwhile
    assert [(a.seq, a.status) for a in answers_queued(comm)] == [(4, "busy")]
    responder.answer("alive")  # no ping since: no answer
    assert answers_queued(comm) == [] and responder.answered == 2
    responder.close(timeout_s=5)
    assert MPI.Request.Testall(pings)  # every ping was taken


def test_a_sender_closing_waits_for_each_target_s_last_answer_and_takes_all_before_it(comm):
    # A PD decode TE-shell closes before its dies do, with no collective after: an answer
    # a die sent after the shell's close was left unreceived, and MPI_Finalize failed on it.
    sender = HeartbeatSender(comm, [0], interval_s=1.0, timeout_s=10)
    sender.tick(0.0)
    assert pings_queued(comm) == [1]  # the target took it
    with pytest.raises(WaitTimeout, match=r"no last heartbeat answer from die rank\(s\) \[0\]"):
        sender.close(timeout_s=0.2, last_from=[0])
    answers = [comm.isend(Pong(seq=seq), dest=0, tag=TAG_HEARTBEAT_ACK) for seq in (1, LAST_SEQ)]
    sender.close(timeout_s=5, last_from=[0])
    assert MPI.Request.Testall(answers) and answers_queued(comm) == []


def test_silent_names_the_targets_unheard_for_longer_than_the_patience(comm):
    """Counted from the later of the first ping and a target's last answer; before any answer
    only past the ceiling (none without one); the pace stretches the patience."""
    sender = HeartbeatSender(comm, [1, 2, 3], interval_s=1.0, timeout_s=10)
    assert sender.silent(50.0) == []  # no ping yet
    sender.started_at = 100.0  # the first ping (no MPI: targets 1-3 are not on COMM_SELF)
    assert sender.silent(200.0) == []  # no answer yet, no ceiling: all still starting
    sender.ceiling_s = 45.0  # the detector's: before the peers' XCCL waits time out
    assert sender.silent(145.0) == [] and sender.silent(145.5) == [1, 2, 3]
    sender.ceiling_s = float("inf")
    sender.last_answer = {1: 105.0, 2: 95.0}  # 3 never answered; 2 before the first ping
    assert sender.silent(110.0) == []  # 10 s: not longer than the patience
    assert sender.silent(110.5) == [2, 3]  # from the first ping
    assert sender.silent(115.5) == [1, 2, 3]
    sender.count_silence(20.0)  # a pace of 20 s: patience 3 x 20 s
    assert sender.silent(160.0) == [] and sender.silent(160.5) == [2, 3]


def _ping(seq: int):
    from ranks.recovery.watch import Ping

    return Ping(seq=seq, sent_at=0.0)
