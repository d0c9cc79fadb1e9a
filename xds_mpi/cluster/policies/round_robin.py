"""round_robin: the TEs in turn, whatever their load: the k-th request routed (from 0) goes to
the (k mod N)-th of the N candidates (the live TEs)."""

from __future__ import annotations

from collections.abc import Sequence

from xds_mpi.cluster.policies import TeState
from xds_mpi.workload.requests import Request


def pick(request: Request, te_states: Sequence[TeState], now_s: float) -> int:
    return te_states[sum(s.num_routed for s in te_states) % len(te_states)].te
