"""The JE's view of its TEs' loads (docs/cluster.md): the requests it routed to each TE and
which of them have finished, as `decide` (xds_mpi/scheduling/admission.py) asks a balancer:
pick, dispatch, complete. The policy picks from the states at the decision's virtual time: the
finishes at or before it applied, the later ones not. With a prompt tree
(xds_mpi/cluster/prompt_tree.py) each state carries the prefix of the request the TE holds; every
decision is kept for the decision log (xds_mpi/cluster/decisions.py)."""

from __future__ import annotations

from collections.abc import Sequence

from xds_mpi.cluster.autoscaler import Autoscaler
from xds_mpi.cluster.decisions import RoutingDecision
from xds_mpi.cluster.policies import Policy, TeState, explain
from xds_mpi.cluster.prompt_tree import PromptTree
from xds_mpi.workload.requests import Request


def request_tokens(req: Request) -> int:
    """What a request weighs in a TE's token load: its prompt plus its output budget."""
    return len(req.prompt) + req.max_new_tokens


class TeLoads:
    """num_tes TEs, routed to by `policy`. A policy always picks a TE, so `decide` decides each
    request at max(its arrival, the previous decision): the virtual time the policy is given.
    kinds: each TE's kind ("colocated", "afd", "pd"; None: every one "colocated"); num_dies:
    each TE's dies (None: 0, unknown); tree: the JE's prompt tree (None: prefix_tokens 0);
    autoscaler: which TEs serve when (None: every one, always); arrival_of: when a request is
    routed at the earliest (a lost TE's orphan: once the loss is found)."""

    def __init__(
        self,
        num_tes: int,
        policy: Policy,
        *,
        kinds: Sequence[str] | None = None,
        num_dies: Sequence[int] | None = None,
        tree: PromptTree | None = None,
        autoscaler: Autoscaler | None = None,
        arrival_of=lambda req: req.arrival_s,
    ) -> None:
        self.policy = policy
        self.autoscaler, self.arrival_of = autoscaler, arrival_of
        self.kinds = tuple(kinds) if kinds is not None else ("colocated",) * num_tes
        self.num_dies = tuple(num_dies) if num_dies is not None else (0,) * num_tes
        if len(self.kinds) != num_tes or len(self.num_dies) != num_tes:
            raise ValueError(
                f"TeLoads: {num_tes} TEs, {len(self.kinds)} kinds, {len(self.num_dies)} die counts"
            )
        self.tree = tree
        self.unfinished: list[dict[int, int]] = [{} for _ in range(num_tes)]  # req_id -> tokens
        self.num_routed = [0] * num_tes
        self.te_of: dict[int, int] = {}  # req_id -> its TE
        self.decided_s = 0.0  # the previous decision's virtual time
        self.lost: set[int] = set()  # TEs lost: no candidates any more
        self.decisions: list[RoutingDecision] = []  # the decision log, in routing order
        self._pending: RoutingDecision | None = None  # picked, not yet dispatched

    def states(self, req: Request | None = None) -> list[TeState]:
        """Every TE's state now; prefix_tokens: `req`'s prompt held there (0 without req)."""
        return [
            TeState(
                te=te,
                num_unfinished=len(reqs),
                unfinished_tokens=sum(reqs.values()),
                num_routed=self.num_routed[te],
                kind=self.kinds[te],
                num_dies=self.num_dies[te],
                prefix_tokens=(
                    self.tree.matched_tokens(req, te) if self.tree and req is not None else 0
                ),
            )
            for te, reqs in enumerate(self.unfinished)
        ]

    def pick(self, req: Request) -> int:
        """The policy's TE among the live ones (a lost TE is no candidate), its decision
        logged once dispatched."""
        now_s = max(self.arrival_of(req), self.decided_s)
        serving = range(len(self.unfinished))
        if self.autoscaler is not None:  # it may scale out or in first, from the loads now
            self.autoscaler.observe(now_s, [len(reqs) for reqs in self.unfinished])
            serving = self.autoscaler.serving(now_s)
        states = [s for s in self.states(req) if s.te not in self.lost and s.te in serving]
        scored = explain(self.policy, req, states, now_s)
        if scored.te not in {state.te for state in states}:
            raise ValueError(
                f"routing policy picked TE {scored.te}, not one of the live TEs "
                f"{[state.te for state in states]}"
            )
        self._pending = RoutingDecision(
            req_id=req.req_id, decided_s=now_s, states=tuple(states), scored=scored
        )
        return scored.te

    def on_dispatch(self, te: int, req: Request) -> None:
        self.unfinished[te][req.req_id] = request_tokens(req)
        self.num_routed[te] += 1
        self.te_of[req.req_id] = te
        self.decided_s = max(self.arrival_of(req), self.decided_s)
        if self.tree is not None:
            self.tree.route(req, te)
        pending, self._pending = self._pending, None
        if pending is not None and pending.req_id == req.req_id and pending.scored.te == te:
            self.decisions.append(pending)

    def on_complete(self, req_id: int) -> None:
        te = self.te_of[req_id]
        self.unfinished[te].pop(req_id, None)
        if self.autoscaler is not None and not self.unfinished[te]:
            self.autoscaler.drained(te)  # a draining TE's last request: standby again
