"""Shared by the fault-recovery bodies (body_faults_*.py): token recomputation on injected XCCL
faults (xDeepServe §6.2 stage 3) at any rank count.

Each test runs iterations of an XCCL workload under a declarative fault table (FaultsConfig rows:
die, op, layer, iteration, times), wraps every iteration as an attempt (notify, interrupt, vote,
resync, re-execute: xccl/recovery/rollback.py) and compares every iteration's outputs with the
single-process oracle bit for bit. Inputs depend only on (rank, event id), so a re-execution sends
the same rows with the same event ids. Every wait has the production poll timeout (60 s): a die
deaf to the rollback would fail its test with XcclTimeout, not merely slow it down.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from xccl.errors import InjectedFault
from xccl.recovery.rollback import Recovery
from xds_mpi.execution.faults import FaultPlan

comm = MPI.COMM_WORLD
LAST = comm.size - 1
POLL_TIMEOUT_S = 60.0
HIDDEN, MAX_TOKENS, TOP_K, EXPERTS_PER_DIE = 8, 8, 2, 2


@pytest.fixture
def recovery():
    rec = Recovery(comm, timeout_s=POLL_TIMEOUT_S)
    yield rec
    comm.Barrier()
    rec.free()


def batch(rank, event, num_experts):
    """Rows that name their source (column 0 = rank, 1 = token); -1 and repeated experts occur."""
    rng = np.random.default_rng((rank, event))
    num_tokens = (rank * 3 + event) % (MAX_TOKENS + 1)
    x = rng.normal(size=(num_tokens, HIDDEN))
    x[:, 0], x[:, 1] = rank, np.arange(num_tokens)
    topk = rng.integers(-1, num_experts, size=(num_tokens, TOP_K))
    return x, topk, rng.random((num_tokens, TOP_K))


def expert_fn(slot, rows):
    return rows * (slot + 1.5) + slot


def fired_attempts(rollbacks):
    """Every die's (iteration, attempt) of the faults it raised, gathered: the distinct ones."""
    return sorted({a for per_die in comm.allgather(rollbacks) for a in per_die})


def counting(plan: FaultPlan, raised: list):
    """`plan`'s fault hook, noting (iteration, attempt) in `raised` each time it injects one."""

    def counted(op, event):
        try:
            plan.check(op, event)
        except InjectedFault:
            raised.append((plan.iteration, plan.attempt))
            raise

    return counted
