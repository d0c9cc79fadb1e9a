"""Recomputed XCCL timeouts without MPI: the vote's words carry a timeout and its peer apart from
an injected fault's code, and the first timeout the dies counted becomes the detection of the
stuck row on its peer (or a `none` record when no row names the peer)."""

from __future__ import annotations

import numpy as np

from ranks.recovery.records import with_timeouts
from xccl.errors import InjectedFault, PeerTimeout
from xccl.recovery.vote import HEADER, decode, encode
from xds_mpi.results.failures import FailureRecord


def words(fault, notified=False, states=(3, 4), waiting=None):
    send = np.zeros(HEADER + 4, np.int64)
    encode(send, notified=notified, fault=fault, states=states, waiting=waiting)
    return send[: HEADER + len(states)].tolist()


def test_the_vote_tells_a_timeout_from_an_injected_fault():
    timeout = PeerTimeout("late", die=2, op="combine", event_id=31, peers=(4, 3))
    rows = [words(None, states=(5, 1)), words(timeout), words(InjectedFault(3, "dispatch", 7, 2))]
    outcome = decode(rows, epoch=4)
    assert outcome.failed and outcome.epoch == 5 and outcome.states == (5, 4)
    late, injected = outcome.faults
    assert (late.die, late.op, late.event_id, late.peer, late.is_timeout) == (
        2,
        "combine",
        31,
        3,  # the lowest missing peer
        True,
    )
    assert str(late) == "die 2 combine event 31 timed out on die 3"
    assert (injected.code, injected.peer, injected.is_timeout) == (2, -1, False)
    assert outcome.timeouts == (late,)


def test_a_timeout_is_blamed_on_the_die_the_waits_lead_to():
    """Expert die 7 times out on trampoline 6, which was waiting for attention die 2 when the
    rollback reached it; die 2 (stalled, not waiting) is the one to blame, not die 6."""
    timeout = PeerTimeout("late", die=7, op="a2e", event_id=60, peers=(6,), since=10.0)
    rows = [words(None), words(None, waiting=(6, 2, 9.5)), words(None), words(timeout)]
    outcome = decode(rows, epoch=0)
    [late] = outcome.timeouts
    assert late.peer == 6 and outcome.blamed(late) == 2
    # Die 2 came back and was interrupted in its next wait, for die 5, which waited for die 2:
    # a cycle; die 2's wait began last (it was busy while 5 waited), so die 2 is blamed.
    rows += [words(None, waiting=(2, 5, 12.0)), words(None, waiting=(5, 2, 9.0))]
    assert decode(rows, epoch=0).blamed(late) == 2
    # Nobody else reported a wait: the timed-out wait's own peer.
    assert decode([words(None), words(timeout)], epoch=0).blamed(late) == 6


def test_a_vote_with_nothing_reported_passes():
    outcome = decode([words(None), words(None)], epoch=2)
    assert not outcome.failed and outcome.epoch == 2 and outcome.faults == ()


def record(kind, die, verdict=""):
    return FailureRecord(
        kind=kind,
        die=die,
        role="colocated",
        injected_iteration=4,
        injected_wall_s=1.0,
        injected_virtual_s=0.5,
        verdict=verdict,
    )


COUNTERS = {"timeouts": 2, "timeout_die": 4, "timeout_peer": 3, "timeout_iteration": 4}


def test_the_first_timeout_detects_the_transient_stall_of_its_peer():
    recovery = {
        1: {**COUNTERS, "timeout_wall": 101.8},
        4: {**COUNTERS, "timeout_wall": 101.5},  # the die that timed out: the earliest time
    }
    stuck = record("stuck", 3, "transient")
    [got] = with_timeouts([stuck], recovery, {3: "colocated"}, started=100.0)
    assert (got.detected_by, got.verdict) == ("xccl timeout", "transient")
    assert abs(got.detection_s - 0.5) < 1e-9 and abs(got.detected_virtual_s - 1.0) < 1e-9
    assert got.recovery.startswith("token recomputation: die rank 4's wait for die rank 3")
    assert "(2 attempts failed on a timeout)" in got.recovery


def test_a_lost_peer_keeps_the_heartbeats_record_and_an_unnamed_slow_die_gets_one():
    recovery = {1: {**COUNTERS, "timeout_wall": 101.5}}
    dead = record("dead", 3, "dead")
    assert with_timeouts([dead], recovery, {3: "colocated"}, started=100.0) == [dead]
    other = record("stuck", 2, "transient")
    kept, slow = with_timeouts([other], recovery, {3: "colocated"}, started=100.0)
    assert kept == other
    assert (slow.kind, slow.die, slow.verdict, slow.detected_by) == (
        "none",
        3,
        "slow",
        "xccl timeout",
    )
    assert with_timeouts([other], {1: {"timeouts": 0}}, {}, started=100.0) == [other]
