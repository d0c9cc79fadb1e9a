"""Point-to-point send/recv pairs restart cleanly after faults on either side
(tests/mpi/faults_common.py)."""

from __future__ import annotations

import numpy as np
import pytest
from faults_common import LAST, POLL_TIMEOUT_S, comm, counting, fired_attempts
from faults_common import recovery as recovery  # the fixture; the alias re-exports it to pytest

from xccl.gmem import DieMemory
from xccl.layout import P2PLayout, all_pairs
from xccl.p2p import P2P
from xccl.recovery.faults import RecoveryHooks
from xccl.reference import tagged_payload
from xds_mpi.config.schema import FaultsConfig
from xds_mpi.execution.faults import FaultPlan, LayerEvents

SLOTS, SLOT = 4, 64
P2P_TABLE = [
    dict(die=0, op="p2p_send", layer=0, iteration=1),  # mid-message (5 fills)
    dict(die=1, op="p2p_recv", layer=0, iteration=3),
    dict(die=LAST, op="p2p_send", layer=0, iteration=5, times=2),
    dict(die=0, op="p2p_recv", layer=0, iteration=6),
    dict(die=1, op="p2p_send", layer=0, iteration=6),
]


@pytest.mark.mpi(min_size=2)
def test_send_recv_pairs_restart_cleanly_after_faults_on_either_side(recovery):
    layout = P2PLayout.build(comm.size, SLOTS, SLOT, all_pairs(range(comm.size)))
    mem = DieMemory(comm, layout.window_bytes(comm.rank))
    p2p = P2P(mem, layout, timeout_s=POLL_TIMEOUT_S)
    plan = FaultPlan(
        FaultsConfig(table=P2P_TABLE), comm.rank, LayerEvents(events_per_iteration=1)
    )  # one layer: 0
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    raised = []
    p2p.set_recovery(RecoveryHooks(interrupt=recovery.interrupt, fault_hook=counting(plan, raised)))
    try:
        for it in range(8):
            nbytes = int(2.5 * SLOTS * SLOT) if it % 2 else 40 + it

            def attempt(k):
                plan.begin(iteration=it, attempt=k)
                out = np.full(nbytes + 8, 0xA5, np.uint8)
                send = p2p.isend(tagged_payload(comm.rank, right, it, nbytes), right, it)
                recv = p2p.irecv(out[:nbytes], left, it)
                send.wait()
                recv.wait()
                return out

            out = recovery.run(attempt, [p2p], max_retries=2, what=f"iteration {it}")
            assert (out[:nbytes] == tagged_payload(left, comm.rank, it, nbytes)).all(), (
                f"iteration {it}: message from rank {left} differs"
            )
            assert (out[nbytes:] == 0xA5).all(), f"iteration {it}: overrun"
        assert fired_attempts(raised) == [(1, 0), (3, 0), (5, 0), (5, 1), (6, 0)]
        assert recovery.epoch == 5
    finally:
        comm.Barrier()
        mem.free()
