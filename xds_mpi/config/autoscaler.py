"""The `autoscaler` section: a cluster's TEs scaled out and in with the load, on the virtual
clock (docs/cluster.md "Scaling"; xds_mpi/cluster/autoscaler.py).

Part of the config schema (`xds_mpi.config.schema` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import non_negative, positive, require


@dataclass(frozen=True, kw_only=True)
class AutoscalerConfig:
    """enabled: scale the cluster's TEs (needs TEs in standby: a `cluster.groups` row with
    standby true). metric: "load", unfinished requests per die of the serving TEs, averaged
    over the last window_s of routing decisions; "slo", the share of the requests finished in
    the last window_s whose TTFT missed run.slo_ttft_ms or whose TPOT missed run.slo_tpot_ms.
    scale_out_above / scale_in_below: the
    thresholds on it (for "slo" shares, at most 1). cooldown_s: virtual seconds after a scale event
    before the next. min_tes / max_tes: serving TEs at least / at most (0: every TE). scale_out_s:
    virtual seconds from the decision until the new TE serves; None: its five scaling steps priced
    by the `scaling` section (path, pre-warming; xds_mpi/scaling/steps.py, docs/scaling.md) for a TE
    of `pod_dies` dies at the DeepSeek-V3 shape: the pod-scale TE an emulated one stands for (the
    model's weights do not fit fewer than 16 dies). fork_fallback: where a scale-out by NPU-fork
    takes the weights when its source TE dies mid-fork (xds_mpi/cluster/scale_out.py): "dram",
    the new TE's server's page cache, which then holds the model preloaded; "cold", object
    storage (no DRAM copy kept)."""

    enabled: bool = False
    metric: Literal["load", "slo"] = "load"
    window_s: float = 2.0
    scale_out_above: float = 4.0
    scale_in_below: float = 1.0
    cooldown_s: float = 5.0
    min_tes: int = 1
    max_tes: int = 0
    scale_out_s: float | None = None
    pod_dies: int = 32
    fork_fallback: Literal["dram", "cold"] = "dram"

    def __post_init__(self) -> None:
        s = "autoscaler"
        positive(s, window_s=self.window_s, min_tes=self.min_tes, pod_dies=self.pod_dies)
        non_negative(
            s,
            cooldown_s=self.cooldown_s,
            max_tes=self.max_tes,
            scale_out_s=self.scale_out_s or 0.0,
            scale_in_below=self.scale_in_below,
        )
        require(
            self.scale_in_below < self.scale_out_above,
            f"autoscaler.scale_in_below({self.scale_in_below}) must be below scale_out_above"
            f"({self.scale_out_above}): else every decision would scale",
        )
        require(
            self.metric != "slo" or self.scale_out_above <= 1,
            f"autoscaler.metric slo is a share of requests: scale_out_above"
            f"({self.scale_out_above}) must be at most 1",
        )
        require(
            self.fork_fallback in ("dram", "cold"),
            f"autoscaler.fork_fallback({self.fork_fallback!r}) must be dram or cold",
        )
        require(
            not self.max_tes or self.max_tes >= self.min_tes,
            f"autoscaler.max_tes({self.max_tes}) must be >= min_tes({self.min_tes}) (0: all)",
        )
