"""The JE's routing policies (docs/cluster.md): one module each in this package, found by name.

A policy module defines `pick(request, te_states, now_s) -> te`: the TE (an index into
`te_states`) that serves `request`, decided at virtual time `now_s` from each TE's state then
(`TeState`). It must be pure: the same arguments give the same TE, so a run's routing depends
only on the config and the seed. A user adds a policy by adding a module here; the JE
(ranks/cluster/je.py) and the config (`cluster.policy`, the module's name) need no change.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xds_mpi.workload.requests import Request


@dataclass(frozen=True, kw_only=True)
class TeState:
    """A TE as the JE sees it at a virtual time: te: its index; num_unfinished: requests routed
    to it that have not finished by then; unfinished_tokens: their prompt plus output budget
    (len(prompt) + max_new_tokens), summed; num_routed: every request routed to it so far."""

    te: int
    num_unfinished: int
    unfinished_tokens: int
    num_routed: int


Policy = Callable[[Request, Sequence[TeState], float], int]


def policy_names() -> list[str]:
    """Every policy module of this package, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load_policy(name: str) -> Policy:
    """The `pick` of policy `name`; ValueError naming the known ones when there is none."""
    if name not in policy_names():
        raise ValueError(f"no routing policy {name!r}; known: {', '.join(policy_names())}")
    return importlib.import_module(f"{__name__}.{name}").pick
