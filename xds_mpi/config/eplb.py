"""The `eplb` section: expert load balancing (xDeepServe §4.5), and what it needs of the rest of
the config (`check_eplb`, called by xds_mpi/plan/deployment.py).

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
from typing import TYPE_CHECKING, Literal

from xds_mpi.config.loader import ConfigError, non_negative, positive

if TYPE_CHECKING:
    from xds_mpi.config.schema import Config


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


def free_slots(cfg: Config, num_routed_dies: int) -> int:
    """Redundant slots per MoE layer EPLB may fill: every routed-expert die's redundant slots,
    less those health.replicas ring keeps for good (xds_mpi/eplb/ring.py: as many per die as
    the next die has routed experts)."""
    return num_routed_dies * (
        cfg.deployment.redundant_slots_per_die - ring_slots(cfg, num_routed_dies)
    )


def ring_slots(cfg: Config, num_routed_dies: int) -> int:
    """Redundant slots per die that health.replicas ring fills (0 without the ring)."""
    if cfg.health.replicas != "ring" or not num_routed_dies:
        return 0
    return -(-cfg.model.num_routed_experts // num_routed_dies)


def budget(cfg: Config, num_routed_dies: int) -> int:
    """Replicas per MoE layer the algorithm places."""
    return cfg.eplb.redundancy_budget or free_slots(cfg, num_routed_dies)


def check_eplb(cfg: Config, num_routed_dies: int) -> None:
    """Refuse an enabled eplb section the deployment cannot serve, naming the numbers."""
    eplb, dep = cfg.eplb, cfg.deployment
    if not eplb.enabled:
        return
    if dep.kind != "colocated":
        raise ConfigError(
            f"eplb.enabled needs a colocated deployment, got deployment.kind={dep.kind!r}: the "
            "attention/expert dies of afd do not swap replicas yet (see README, EPLB)"
        )
    if cfg.pd.enabled:
        raise ConfigError(
            "eplb.enabled with pd.enabled: the PD decode dies and the prefill dies do not swap "
            "replicas yet; turn one of them off"
        )
    free = free_slots(cfg, num_routed_dies)
    ring = ring_slots(cfg, num_routed_dies)
    if free <= 0:
        raise ConfigError(
            "eplb.enabled needs redundant slots: deployment.redundant_slots_per_die is "
            f"{dep.redundant_slots_per_die} on {num_routed_dies} routed-expert dies"
            + (f", {ring} of them the ring's (health.replicas ring)" if ring else "")
            + f"; set it to {ring + 1} or more"
        )
    if eplb.redundancy_budget > free:
        raise ConfigError(
            f"eplb.redundancy_budget({eplb.redundancy_budget}) > free redundant slots per MoE "
            f"layer: {num_routed_dies} routed-expert dies x deployment.redundant_slots_per_die"
            f"({dep.redundant_slots_per_die})"
            + (f" less the ring's {ring} per die" if ring else "")
            + f" = {free}"
        )
