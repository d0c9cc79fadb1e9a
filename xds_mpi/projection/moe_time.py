"""The MoE time per iteration a measured die load implies at the cost shape (DeepSeek-V3 on the
hardware profile), priced as the die's pricer prices a MoE layer (xds_mpi/execution/pricing.py): a
die's routed rows, scaled from the tiny top-k to the cost shape's, spread over the cost shape's
experts per die; the slowest die sets the layer's pace for the experts and for dispatch.
Attention and the other dies' waiting are left out, so placements compare on the MoE alone."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.config.hardware import load_profile
from xds_mpi.model.shapes import cost_shape
from xds_mpi.projection.cost import CostModel, Hardware


@dataclass(frozen=True, kw_only=True)
class MoePricing:
    """cost: the cost model; layer_scales: [num_moe_layers] cost-shape layers each emulated MoE
    layer stands for (MTP layers: 1); topk_scale: cost top-k / tiny top-k; experts_per_die: the
    cost shape's routed experts per routed die."""

    cost: CostModel
    layer_scales: tuple[float, ...]
    topk_scale: float
    experts_per_die: int
    num_dies: int
    use_int8: bool

    @classmethod
    def from_config(cls, cfg, num_routed_dies: int) -> MoePricing:
        big, tiny = cost_shape(), cfg.model
        scale = (big.num_layers - big.num_dense_layers) / (tiny.num_layers - tiny.num_dense_layers)
        num_main = tiny.num_layers - tiny.num_dense_layers
        return cls(
            cost=CostModel(big, Hardware.from_profile(load_profile(cfg.hardware.profile))),
            layer_scales=(scale,) * num_main + (1.0,) * cfg.scheduler.mtp_depth,
            topk_scale=big.top_k / tiny.top_k,
            experts_per_die=max(1, round(big.num_routed_experts / num_routed_dies)),
            num_dies=num_routed_dies,
            use_int8=cfg.xccl.use_int8,
        )

    def ms(self, die_rows: np.ndarray, rows_scale: float = 1.0) -> float:
        """MoE ms per iteration. die_rows: [num_moe_layers, num_dies] routed rows each die
        received in one iteration (tiny top-k); rows_scale: multiply every die's rows (a larger
        batch with the same skew); nan: a die lost to vertical scaling, left out."""
        total = 0.0
        for rows, scale in zip(die_rows, self.layer_scales):
            big = np.asarray(rows, np.float64) * self.topk_scale * rows_scale  # [dies]
            big = big[~np.isnan(big)]  # a die lost to vertical scaling (nan) serves nothing
            experts = max(self.cost.routed(r, self.experts_per_die) for r in big)
            dispatch = self.cost.dispatch(float(big.max()), peers=self.num_dies, int8=self.use_int8)
            total += scale * (experts + dispatch)
        return total * 1e3
