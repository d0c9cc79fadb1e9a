"""The JE's routing policies (docs/cluster.md): one module each in this package, found by name.

A policy module defines `pick(request, te_states, now_s) -> te`: the TE (the `te` of one of
`te_states`, the candidates: the live TEs) that serves `request`, decided at virtual time
`now_s` from each TE's state then (`TeState`). A policy that needs the config (a map, a
predictor) defines `make(cfg) -> pick` instead, called once when the JE starts. A pick must be
pure: the same arguments give the same TE, so a run's routing depends only on the config and
the seed. A user adds a policy by adding a module here; the JE (ranks/cluster/je.py) and the
config (`cluster.policy`, the module's name) need no change.

A policy that scores the TEs makes its pick a `ScoredPolicy`: the decision log
(xds_mpi/cluster/decisions.py) then keeps each TE's score and how the policy got there (`Scored`).
A module may define `check(cfg)`, raising ConfigError naming the key, which `xds-mpi validate`
runs (xds_mpi/plan/cluster.py).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xds_mpi.workload.requests import Request

if TYPE_CHECKING:
    from xds_mpi.config.schema import Config


@dataclass(frozen=True, kw_only=True)
class TeState:
    """A TE as the JE sees it at a virtual time: te: its index; num_unfinished: requests routed
    to it that have not finished by then; unfinished_tokens: their prompt plus output budget
    (len(prompt) + max_new_tokens), summed; num_routed: every request routed to it so far;
    kind: "colocated", "afd" or "pd" (a PD-disaggregated pair: its prefill and decode dies);
    num_dies: its dies; prefix_tokens: the tokens of this request's prompt the JE's prompt tree
    holds for this TE (its reusable KV cache as the JE knows it; 0 without one)."""

    te: int
    num_unfinished: int
    unfinished_tokens: int
    num_routed: int
    kind: str = "colocated"
    num_dies: int = 0
    prefix_tokens: int = 0


Policy = Callable[[Request, Sequence[TeState], float], int]


def load_key(state: TeState) -> tuple[int, int, int]:
    """least_load's order (lowest first): unfinished requests, then unfinished tokens, then the
    TE's index; the tie-break of every policy that falls back to the load."""
    return state.num_unfinished, state.unfinished_tokens, state.te


@dataclass(frozen=True, kw_only=True)
class Scored:
    """A scored decision: te: the TE picked; scores: per candidate (in the order of the states
    the policy was given) the policy's score, higher better, NaN for a TE it did not consider;
    note: how it narrowed the TEs (a heatmap's value, a branch), for the decision log."""

    te: int
    scores: tuple[float, ...]
    note: str = ""


class ScoredPolicy:
    """A Policy whose decision says why: called, it picks; `scored` gives the whole `Scored`."""

    def __init__(self, scored: Callable[[Request, Sequence[TeState], float], Scored]) -> None:
        self.scored = scored

    def __call__(self, request: Request, te_states: Sequence[TeState], now_s: float) -> int:
        return self.scored(request, te_states, now_s).te


def explain(policy: Policy, request: Request, te_states: Sequence[TeState], now_s: float) -> Scored:
    """`policy`'s decision with its scores (NaN for a policy that does not score)."""
    if isinstance(policy, ScoredPolicy):
        return policy.scored(request, te_states, now_s)
    return Scored(te=policy(request, te_states, now_s), scores=(math.nan,) * len(te_states))


def policy_names() -> list[str]:
    """Every policy module of this package, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load_policy(name: str, cfg: Config | None = None) -> Policy:
    """The `pick` of policy `name` (its `make(cfg)`'s for a policy that needs the config);
    ValueError naming the known ones when there is none."""
    if name not in policy_names():
        raise ValueError(f"no routing policy {name!r}; known: {', '.join(policy_names())}")
    module = importlib.import_module(f"{__name__}.{name}")
    make = getattr(module, "make", None)
    if make is None:
        return module.pick
    if cfg is None:
        raise ValueError(f"routing policy {name!r} needs the config (it defines make)")
    return make(cfg)


def check_policy(cfg: Config) -> None:
    """`cluster.policy` names a policy module, and the config holds what it needs (its
    module's `check(cfg)`, if it has one); ConfigError naming the key. The launcher calls it
    for a cluster (launch/cli/main.py `_load`): the plan (xds_mpi/plan/) sits below the
    policies, which read the config's files."""
    # Lazy import: ConfigError's module is the config layer's.
    from xds_mpi.config.loader import ConfigError

    if cfg.cluster.policy not in policy_names():
        raise ConfigError(
            f"cluster.policy({cfg.cluster.policy}) is no routing policy; known: "
            f"{', '.join(policy_names())} (xds_mpi/cluster/policies/)"
        )
    check = getattr(importlib.import_module(f"{__name__}.{cfg.cluster.policy}"), "check", None)
    if check is not None:
        check(cfg)
