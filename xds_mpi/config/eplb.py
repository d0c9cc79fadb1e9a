"""The `eplb` section: expert load balancing (xDeepServe §4.5). What it needs of the rest of the
config is checked in xds_mpi/plan/eplb.py.

enabled: collect, rebalance and swap replicas while decoding. interval: decode iterations per
time slice (every die sends its slice's counts to the TE-shell). slices: time slices the
algorithm looks at; a rebalance runs after every `slices` new slices. redundancy_budget: replicas
per MoE layer (0 = every redundant slot of the deployment). policy: flowserve (§4.5 Step 2),
deepseek (DeepSeek's EPLB, hierarchical over servers) or none (collect and report only: the
baseline). load_slots_per_iteration: redundant slots a die loads weights into per decode
iteration (Step 3 phase 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import non_negative, positive


@dataclass(frozen=True, kw_only=True)
class EplbConfig:
    enabled: bool = False
    interval: int = 8
    slices: int = 4
    redundancy_budget: int = 0
    policy: Literal["flowserve", "deepseek", "none"] = "flowserve"
    load_slots_per_iteration: int = 1

    def __post_init__(self) -> None:
        positive(
            "eplb",
            interval=self.interval,
            slices=self.slices,
            load_slots_per_iteration=self.load_slots_per_iteration,
        )
        non_negative("eplb", redundancy_budget=self.redundancy_budget)
