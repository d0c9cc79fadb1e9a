"""MTP drafting bookkeeping on a die (xDeepServe §4.6; DeepSeek-V3 MTP), apart from execution.

FlowServe's step is: draft D tokens with the MTP modules, verify [last token, drafts] with the
main model, keep the agreeing prefix plus one main-model token. On a die the MTP modules run right
after the main model, in the same iteration, over the positions the step just committed, so the
next iteration's verify rows are ready without a second pass over the main model.

Module k at position i needs h^{k-1}_i (h^0 = the main model's last block) and token t_{i+k}; its
cache entry is kept ("committed") when t_{i+k} is a committed token, otherwise it is recomputed
next step. Per request the die keeps, for each depth, the next position to compute and the
committed h^{k-1} rows not yet consumed; a pass at depth k takes those rows plus the rows depth
k - 1 computed from drafts in this iteration (speculative). This mirrors the single-process
reference (xds_mpi/model/reference.py) entry for entry, so a die drafts the same tokens.

Updates are staged per iteration and applied by `commit`, so a failed iteration leaves no trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True)
class MtpState:
    """One request. next_pos[k]: first position depth k + 1 has not committed. rows[k]: committed
    h^k rows at positions next_pos[k], next_pos[k] + 1, ... (h^0 from the main model)."""

    next_pos: list[int]
    rows: list[list[np.ndarray]]

    @classmethod
    def new(cls, depth: int) -> MtpState:
        return cls(next_pos=[0] * depth, rows=[[] for _ in range(depth)])

    def copy(self) -> MtpState:
        return MtpState(next_pos=list(self.next_pos), rows=[list(r) for r in self.rows])


@dataclass(kw_only=True)
class MtpWork:
    """One request's part of this iteration's MTP passes."""

    req_id: int
    context: list[int]  # committed tokens after this step (prompt + generated)
    state: MtpState  # staged: becomes the request's state on commit
    is_drafting: bool  # decoding: its last row at each depth yields a draft
    drafts: list[int] = field(default_factory=list)
    speculative: list[np.ndarray] = field(default_factory=list)  # h^{k-1} from drafts
    start: int = 0  # this depth's positions [start, stop)
    stop: int = 0

    def plan(self, depth: int) -> int:
        """Positions for MTP depth `depth`; returns how many rows it computes."""
        state, k = self.state, depth - 1
        self.start = state.next_pos[k]
        available = len(state.rows[k]) + len(self.speculative)
        extended = len(self.context) + len(self.drafts)
        self.stop = min(self.start + available, extended - depth)
        if self.is_drafting and self.stop != len(self.context) - 1:
            raise AssertionError(
                f"request {self.req_id}: MTP depth {depth} reaches position "
                f"{self.stop}, drafting needs {len(self.context) - 1}"
            )
        return max(self.stop - self.start, 0)

    def inputs(self, depth: int) -> tuple[list[np.ndarray], list[int]]:
        """(h^{depth-1} rows, tokens t_{i+depth}) for positions [start, stop)."""
        num = self.stop - self.start
        prev = (self.state.rows[depth - 1] + self.speculative)[:num]
        extended = self.context + self.drafts
        return prev, extended[self.start + depth : self.stop + depth]

    def keep(self, depth: int, out: np.ndarray | None, num_depths: int) -> None:
        """out: [stop - start, hidden] h^depth (None: no rows). Depth's entries are committed up
        to the first that used a draft; its committed h^{depth-1} rows are consumed; h^depth
        goes on to depth + 1 (committed rows kept, the rest speculative)."""
        state, k = self.state, depth - 1
        committed = max(self.start, min(self.stop, len(self.context) - depth))
        state.rows[k] = state.rows[k][committed - self.start :]
        state.next_pos[k] = committed
        self.speculative = []
        if depth == num_depths or out is None:
            return
        rows = list(out)
        state.rows[depth].extend(rows[: committed - self.start])
        self.speculative = rows[committed - self.start :]


class MtpBook:
    """Every request's MTP state on this die; an iteration stages, `commit` applies."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.states: dict[int, MtpState] = {}
        self.staged: dict[int, MtpState] = {}

    def start(
        self, req_id: int, context: list[int], h0_rows: np.ndarray, *, is_drafting: bool
    ) -> MtpWork:
        """A request's work this iteration: h0_rows [n, hidden] are the main model's committed
        rows of this step (the prompt chunk, or t_m and the accepted drafts)."""
        state = self.states.get(req_id)
        state = MtpState.new(self.depth) if state is None else state.copy()
        state.rows[0].extend(h0_rows)
        self.staged[req_id] = state
        return MtpWork(req_id=req_id, context=context, state=state, is_drafting=is_drafting)

    def commit(self, finished: set[int]) -> None:
        self.states.update(self.staged)
        for req_id in finished:
            self.states.pop(req_id, None)
        self.staged = {}

    def discard(self) -> None:
        self.staged = {}
