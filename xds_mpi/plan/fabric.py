"""The deployment's XCCL memory: which die pairs talk p2p, and how big each die's window is.

Helpers of `xds_mpi.plan.deployment.DeploymentPlan.build`, the one place that calls them: role
programs and the launcher take the layouts and window sizes from the plan.
"""

from __future__ import annotations

from xccl.layout import P2PLayout, all_pairs
from xccl.moe_layout import AfdLayout, EpLayout
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.plan.topology import Topology


def p2p_pairs(cfg: Config, topo: Topology) -> frozenset[tuple[int, int]]:
    """Ordered (src rank, dst rank) pairs that get a ring, as xccl.p2p_pairs declares:
    none; all (every die with every die, itself included); prefill_to_decode (KV transfer from
    each prefill die to each attention / colocated die)."""
    kind = cfg.xccl.p2p_pairs
    if kind == "none":
        return frozenset()
    if kind == "all":
        return all_pairs(topo.die_ranks)
    decode = topo.ranks_with_role("attention") + topo.ranks_with_role("colocated")
    return frozenset((p, d) for p in topo.ranks_with_role("prefill") for d in decode)


def p2p_layout(cfg: Config, topo: Topology) -> P2PLayout:
    x = cfg.xccl
    return P2PLayout.build(topo.world_size, x.ring_slots, x.slot_bytes, p2p_pairs(cfg, topo))


def ep_layout(cfg: Config, topo: Topology, p2p: P2PLayout, itemsize: int) -> EpLayout | None:
    """Dispatch/combine area of a colocated deployment, after each die's p2p area; rows of
    `itemsize` bytes (xccl.row_dtype) when not INT8; one lane per microbatch (two-stream
    decode, xds_mpi/execution/two_streams.py)."""
    if cfg.deployment.kind != "colocated":
        return None
    shared_column = 1 if cfg.deployment.shared_experts == "dedicated" else 0
    members = topo.ranks_with_role("colocated")
    return EpLayout(
        members=members,
        base=tuple(p2p.window_bytes(r) for r in range(topo.world_size)),
        hidden=cfg.model.hidden,
        max_tokens=cfg.xccl.max_tokens_per_die,
        num_columns=cfg.model.top_k + shared_column,
        itemsize=itemsize,
        use_int8=cfg.xccl.use_int8,
        max_slots_per_die=max(len(topo.ranks[r].expert_slots) for r in members),
        num_lanes=cfg.deployment.num_microbatches,
    )


def afd_layout(cfg: Config, topo: Topology, p2p: P2PLayout, itemsize: int) -> AfdLayout | None:
    """A2E/E2A area of an afd deployment, after each die's p2p area: one lane per DP domain x
    microbatch; a shared-expert column whenever the model has shared experts."""
    if cfg.deployment.kind != "afd":
        return None
    dep = cfg.deployment
    return AfdLayout(
        attention=topo.ranks_with_role("attention"),
        experts=topo.ranks_with_role("expert"),
        group_size=dep.dp_groups_per_domain,
        base=tuple(p2p.window_bytes(r) for r in range(topo.world_size)),
        num_lanes=dep.num_dp_domains * dep.num_microbatches,
        hidden=cfg.model.hidden,
        max_tokens=cfg.xccl.max_tokens_per_die,
        top_k=cfg.model.top_k,
        has_shared=cfg.model.num_shared_experts > 0,
        itemsize=itemsize,
        use_int8=cfg.xccl.use_int8,
    )


def window_bytes(
    cfg: Config, p2p: P2PLayout, ep: EpLayout | None, afd: AfdLayout | None
) -> tuple[int, ...]:
    """Size hint: bytes of every rank's window (host ranks: 0), refused over the per-die cap."""
    sizes = [p2p.window_bytes(rank) for rank in range(p2p.num_ranks)]
    if ep is not None:
        for rank in ep.members:
            sizes[rank] += ep.area_bytes()
    if afd is not None:
        for rank in afd.attention + afd.experts:
            sizes[rank] += afd.area_bytes(afd.role_of(rank))
    cap = cfg.xccl.max_window_bytes
    for rank, size in enumerate(sizes):
        if size > cap:
            moe_bytes = size - p2p.window_bytes(rank)
            area = "A2E/E2A" if afd is not None else "dispatch/combine"
            raise ConfigError(
                f"rank {rank}'s window needs {size} B = p2p {p2p.window_bytes(rank)}"
                f" B + {area} {moe_bytes} B, over the per-die cap "
                f"xccl.max_window_bytes({cap})"
            )
    return tuple(sizes)


def format_bytes(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"
