"""A wait that times out on a slow peer (not a lost one) fails the attempt like an injected fault
when recovery asks for it (xccl/recovery/rollback.py recover_timeouts, faults.on_timeout recompute):
every die rolls back and the re-execution serves the oracle's outputs; a peer late in every attempt
exhausts the retries with an error naming die, peer and event."""

from __future__ import annotations

import time

import numpy as np
import pytest
from body_faults_ep import EpGroup, ep_event
from faults_common import LAST, POLL_TIMEOUT_S, comm

from xccl.errors import RetriesExhausted
from xccl.recovery.faults import RecoveryHooks
from xccl.recovery.rollback import Recovery

# A slow peer, not a lost one (faults.on_timeout recompute): its peers' dispatch waits time out,
# the attempt fails like an injected fault, and the re-execution serves the oracle's outputs.
SLOW_TIMEOUT_S, SLOW_S = 0.5, 1.5


class SlowPeer:
    """LAST sleeps SLOW_S inside its first dispatch (staged, unpublished) of the attempts
    `arm()` armed: the others' waits for its record time out."""

    def __init__(self, every_attempt):
        self.is_armed, self.every_attempt = True, every_attempt

    def arm(self, attempt):
        self.is_armed = self.is_armed or self.every_attempt

    def hook(self, op, event):
        if comm.rank == LAST and op == "dispatch" and self.is_armed:
            self.is_armed = False
            time.sleep(SLOW_S)


def slow_group(every_attempt):
    group, slow = EpGroup(), SlowPeer(every_attempt)
    recovery = Recovery(
        comm, timeout_s=SLOW_TIMEOUT_S, recover_timeouts=True, vote_timeout_s=POLL_TIMEOUT_S
    )
    group.ep.timeout_s = SLOW_TIMEOUT_S
    group.ep.set_recovery(RecoveryHooks(interrupt=recovery.interrupt, fault_hook=slow.hook))

    def attempt(k):
        slow.arm(k)
        return group.iteration(0)

    return group, recovery, attempt


@pytest.mark.mpi(min_size=2)
def test_a_wait_that_times_out_on_a_slow_peer_is_recomputed():
    group, recovery, attempt = slow_group(every_attempt=False)
    outcomes = []
    try:
        ys = recovery.run(
            attempt, [group.ep], max_retries=3, what="iteration 0", on_rollback=outcomes.append
        )
        assert all(np.array_equal(a, b) for a, b in zip(ys, group.oracle(0)))
        assert outcomes, "no attempt failed: the slow peer was not late"
        first = outcomes[0]
        assert first.timeouts == first.faults and first.timeouts, first  # nothing injected
        assert LAST in {f.peer for f in first.timeouts}, first
        assert all(f.die != LAST and f.op == "dispatch" for f in first.timeouts), first
        assert {f.event_id for f in first.timeouts} == {ep_event(0, 0)}, first
    finally:
        comm.Barrier()
        recovery.free()
        group.close()


@pytest.mark.mpi(min_size=2)
def test_a_peer_late_in_every_attempt_exhausts_the_retries_naming_die_peer_and_event():
    group, recovery, attempt = slow_group(every_attempt=True)
    try:
        with pytest.raises(RetriesExhausted) as caught:
            recovery.run(attempt, [group.ep], max_retries=1, what="iteration 0")
        assert recovery.epoch == 2
        message = str(caught.value)
        assert message.startswith(f"die rank {comm.rank}: iteration 0 failed 2 attempts"), message
        assert f"dispatch event {ep_event(0, 0)} timed out on die {LAST}" in message, message
    finally:
        comm.Barrier()
        recovery.free()
        group.close()
