"""least_load: the TE with the fewest unfinished requests at the decision's virtual time; ties
go to the fewest unfinished tokens (prompt plus output budget), then to the lowest index."""

from __future__ import annotations

from collections.abc import Sequence

from xds_mpi.cluster.policies import TeState
from xds_mpi.workload.requests import Request


def pick(request: Request, te_states: Sequence[TeState], now_s: float) -> int:
    return min(te_states, key=lambda s: (s.num_unfinished, s.unfinished_tokens, s.te)).te
