"""The JE's view of its TEs' loads (docs/cluster.md): the requests it routed to each TE and
which of them have finished, as `decide` (xds_mpi/scheduling/admission.py) asks a balancer:
pick, dispatch, complete. The policy picks from the states at the decision's virtual time: the
finishes at or before it applied, the later ones not."""

from __future__ import annotations

from xds_mpi.cluster.policies import Policy, TeState
from xds_mpi.workload.requests import Request


def request_tokens(req: Request) -> int:
    """What a request weighs in a TE's token load: its prompt plus its output budget."""
    return len(req.prompt) + req.max_new_tokens


class TeLoads:
    """num_tes TEs, routed to by `policy`. A policy always picks a TE, so `decide` decides each
    request at max(its arrival, the previous decision): the virtual time the policy is given."""

    def __init__(self, num_tes: int, policy: Policy) -> None:
        self.policy = policy
        self.unfinished: list[dict[int, int]] = [{} for _ in range(num_tes)]  # req_id -> tokens
        self.num_routed = [0] * num_tes
        self.te_of: dict[int, int] = {}  # req_id -> its TE
        self.decided_s = 0.0  # the previous decision's virtual time
        self.lost: set[int] = set()  # TEs lost: no candidates any more

    def states(self) -> list[TeState]:
        return [
            TeState(
                te=te,
                num_unfinished=len(reqs),
                unfinished_tokens=sum(reqs.values()),
                num_routed=self.num_routed[te],
            )
            for te, reqs in enumerate(self.unfinished)
        ]

    def pick(self, req: Request) -> int:
        """The policy's TE among the live ones (a lost TE is no candidate)."""
        states = [state for state in self.states() if state.te not in self.lost]
        te = self.policy(req, states, max(req.arrival_s, self.decided_s))
        if te not in {state.te for state in states}:
            raise ValueError(
                f"routing policy picked TE {te}, not one of the live TEs "
                f"{[state.te for state in states]}"
            )
        return te

    def on_dispatch(self, te: int, req: Request) -> None:
        self.unfinished[te][req.req_id] = request_tokens(req)
        self.num_routed[te] += 1
        self.te_of[req.req_id] = te
        self.decided_s = max(req.arrival_s, self.decided_s)

    def on_complete(self, req_id: int) -> None:
        self.unfinished[self.te_of[req_id]].pop(req_id, None)
