"""The JE's decision log (docs/routing.md): per routed request, every TE's state as the policy saw
it (`TeState`), the policy's score for each TE where it scores, how it narrowed them, and the TE
it chose; written to the run file as /cluster/decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xds_mpi.cluster.policies import Scored, TeState

STATE_COUNTS = ("num_unfinished", "unfinished_tokens", "num_routed", "num_dies", "prefix_tokens")


@dataclass(frozen=True, kw_only=True)
class RoutingDecision:
    """req_id routed at virtual decided_s from states (one per candidate: the live TEs);
    scored: the policy's decision (its te, scores in the states' order, note)."""

    req_id: int
    decided_s: float
    states: tuple[TeState, ...]
    scored: Scored

    @property
    def te(self) -> int:
        return self.scored.te


def write_decisions(parent, decisions: Sequence[RoutingDecision]) -> None:
    """/cluster/decisions in `parent` (an h5py group), one row per decision in routing order:
    req_id, decided_s, te [n]; note [n] strings; score [n, num_tes] (NaN: no score); kind
    [n, num_tes] strings; and each of STATE_COUNTS [n, num_tes] int64. A TE that was no
    candidate (lost by then) has NaN, '' and -1."""
    import h5py  # lazy: the JE writes once, after serving

    group = parent.create_group("decisions")
    group["req_id"] = np.array([d.req_id for d in decisions], np.int64)
    group["decided_s"] = np.array([d.decided_s for d in decisions], np.float64)
    group["te"] = np.array([d.te for d in decisions], np.int64)
    strings = h5py.string_dtype()
    group["note"] = np.array([d.scored.note for d in decisions], dtype=strings)
    num_tes = 1 + max((s.te for d in decisions for s in d.states), default=-1)

    def by_te(decision: RoutingDecision, values, missing) -> list:
        """One value per TE by its index; `missing` for a TE that was no candidate (lost)."""
        row = [missing] * num_tes
        for state, value in zip(decision.states, values, strict=True):
            row[state.te] = value
        return row

    group["score"] = np.array(
        [by_te(d, d.scored.scores, np.nan) for d in decisions], np.float64
    ).reshape(len(decisions), num_tes)
    group["kind"] = np.array(
        [by_te(d, [s.kind for s in d.states], "") for d in decisions], dtype=strings
    ).reshape(len(decisions), num_tes)
    for name in STATE_COUNTS:
        group[name] = np.array(
            [by_te(d, [getattr(s, name) for s in d.states], -1) for d in decisions], np.int64
        ).reshape(len(decisions), num_tes)


def read_decisions(path) -> dict[str, np.ndarray]:
    """/cluster/decisions of a run file, column -> array (strings decoded)."""
    import h5py

    with h5py.File(path, "r") as f:
        group = f["cluster/decisions"]
        out = {}
        for name, data in group.items():
            values = data[()]
            if data.dtype.kind == "O":
                values = np.array(data.asstr()[()], dtype=object)
            out[name] = values
        return out
