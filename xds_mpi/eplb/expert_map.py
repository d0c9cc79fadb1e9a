"""A die's live expert map: which logical expert each physical slot holds in each MoE layer
(log2phy for dispatch, phy2log for its own slots), the weights its redundant slots hold, and the
tokens per logical expert its gate chose (§4.5 Step 1, the Collect kernel after the gate).

Without EPLB the map is the topology's, the same in every layer. With EPLB the die's agent
(ranks/colocated/eplb.py) swaps placements in at iteration boundaries every die agrees on; a
redundant slot computes with the weights loaded into it, never with the model's own copy, so a slot
enabled before its load would compute with no weights at all and fail loudly.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.eplb.placement import Placement
from xds_mpi.model.layers import SwiGLU


class ExpertMap:
    def __init__(self, placement: Placement, moe_layers: tuple[int, ...]) -> None:
        """moe_layers: model layer index (MTP depth k: num_layers + k - 1) of each placement
        row, in order."""
        self.placement = placement
        self.moe_layers = moe_layers
        self.row_of = {layer_idx: row for row, layer_idx in enumerate(moe_layers)}
        self._log2phy = [placement.log2phy(r) for r in range(len(moe_layers))]
        # (row, slot) -> (logical expert, its weights) loaded into the redundant slot
        self.weights: dict[tuple[int, int], tuple[int, SwiGLU]] = {}
        num_experts = placement.num_experts
        self.counts = np.zeros((len(moe_layers), num_experts), np.int64)  # [rows, E] this iteration
        self.rows_in = np.zeros(len(moe_layers), np.int64)  # [rows] rows this die received
        self.has_prefill = False

    @classmethod
    def static(cls, phy2log: tuple[int, ...], moe_layers: tuple[int, ...]) -> ExpertMap:
        """The topology's placement in every layer (no EPLB: which die owns a slot is XCCL's
        slot_owner and does not matter here)."""
        slot_die = (0,) * len(phy2log)
        return cls(Placement.static(phy2log, slot_die, len(moe_layers)), moe_layers)

    def install(self, placement: Placement) -> None:
        """Use `placement` from the next MoE call on (Step 3 phases 2 and 4)."""
        self.placement = placement
        self._log2phy = [placement.log2phy(r) for r in range(len(self.moe_layers))]

    def hosted(self, layer_idx: int, slots) -> list[int]:
        """The logical experts whose own weights `slots` (routed slots of this die) compute
        with at MoE layer `layer_idx`: redundant slots hold loaded copies, empty ones none."""
        row = self.row_of[layer_idx]
        phy2log, is_redundant = self.placement.phy2log[row], self.placement.is_redundant
        return [phy2log[s] for s in slots if not is_redundant[s] and phy2log[s] >= 0]

    def log2phy(self, layer_idx: int) -> tuple[tuple[int, ...], ...]:
        return self._log2phy[self.row_of[layer_idx]]

    def phy2log(self, layer_idx: int) -> tuple[int, ...]:
        """The logical expert in each physical slot at MoE layer `layer_idx` (-1 = empty)."""
        return self.placement.phy2log[self.row_of[layer_idx]]

    def start_iteration(self, *, has_prefill: bool) -> None:
        """Zero the counts: an iteration re-run after a fault counts once. has_prefill: the
        batch holds prompt rows (its load is not a decode step's)."""
        self.has_prefill = has_prefill
        self.counts[:] = 0
        self.rows_in[:] = 0

    def collect(self, layer_idx: int, topk_idx: np.ndarray, num_rows_in: int) -> None:
        """Step 1: tokens per logical expert chosen by this die's gate (topk_idx [T, K], -1 =
        none) and the routed rows dispatch delivered to this die."""
        row = self.row_of[layer_idx]
        chosen = topk_idx[topk_idx >= 0]
        self.counts[row] += np.bincount(chosen, minlength=self.placement.num_experts)
        self.rows_in[row] += num_rows_in

    def expert_forward(self, moe, layer_idx: int, slot: int, x: np.ndarray) -> np.ndarray:
        """Routed slot `slot` of MoE layer `layer_idx`: x [n, hidden] -> [n, hidden]."""
        row = self.row_of[layer_idx]
        expert_idx = self.placement.phy2log[row][slot]
        if not self.placement.is_redundant[slot]:
            return moe.expert_forward(expert_idx, x)
        loaded_idx, weights = self.weights.get((row, slot), (-1, None))
        if loaded_idx != expert_idx or weights is None:
            raise RuntimeError(
                f"layer {layer_idx} slot {slot}: rows for expert {expert_idx} arrived at a "
                f"redundant slot holding the weights of expert {loaded_idx}"
            )
        return weights(x)

    def load(self, row: int, slot: int, expert_idx: int, weights: SwiGLU) -> None:
        """Step 3 phase 3: the slot's own copy of expert `expert_idx`'s weights."""
        self.weights[(row, slot)] = (expert_idx, weights)
