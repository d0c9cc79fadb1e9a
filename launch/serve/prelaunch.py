"""What `xds-mpi serve` says before it launches: a deployment whose heartbeats would find a lost
die but whose experts live on that die alone stops serving at the first lost die (ranks/recovery/
scale_down.py refuses to go on without an expert: health.on_expert_lost=stop), and the clients
then see connection errors until someone restarts it. The refusal is right; the served user
hears of it here, with the keys that keep the server up (health.replicas=ring)."""

from __future__ import annotations

from xds_mpi.plan.deployment import DeploymentPlan


def expert_loss_warning(plan: DeploymentPlan) -> str:
    """The warning for `plan` ("" when a lost die cannot stop the server: no heartbeats, PD, a
    restart policy, ring replicas (the validator saw that they fit), or every expert with a
    replica on another die)."""
    cfg = plan.cfg
    # ranks/recovery/watch.py is_watched: a TE-shell watches colocated and afd dies without PD
    # (PD watches a decode die only for a dead row, which wants ring replicas; imported, that
    # module would start MPI in the launcher)
    is_watched = cfg.health.enabled and not cfg.pd.enabled
    if not is_watched or cfg.health.on_expert_lost != "stop" or cfg.health.replicas == "ring":
        return ""
    alone = experts_alone(plan)
    if not alone:
        return ""
    rank, experts = next(iter(sorted(alone.items())))
    most = max(len(e) for e in alone.values())
    return (
        f"heartbeats watch the dies (health.enabled), but {len(alone)} dies hold experts no "
        f"other die has (health.replicas=none; e.g. die rank {rank}: routed "
        f"experts {_span(experts)}), and health.on_expert_lost=stop: one lost die stops the "
        "server and every open request. To keep serving through a lost die: --set "
        f"health.replicas=ring --set deployment.redundant_slots_per_die={most} (docs/failures.md)"
    )


def experts_alone(plan: DeploymentPlan) -> dict[int, tuple[int, ...]]:
    """die rank -> the routed experts only that die holds, in the placement the run starts
    with (EPLB's replicas come and go, and are not counted on)."""
    holders: dict[int, set[int]] = {}  # expert -> dies holding it
    for info in plan.topo.ranks:
        for slot in info.expert_slots:
            if slot.kind in ("routed", "redundant") and slot.expert_idx >= 0:
                holders.setdefault(slot.expert_idx, set()).add(info.rank)
    alone: dict[int, list[int]] = {}
    for expert, dies in sorted(holders.items()):
        if len(dies) == 1:
            alone.setdefault(next(iter(dies)), []).append(expert)
    return {rank: tuple(experts) for rank, experts in alone.items()}


def _span(experts: tuple[int, ...]) -> str:
    if len(experts) > 2 and experts == tuple(range(experts[0], experts[-1] + 1)):
        return f"{experts[0]}-{experts[-1]}"
    return ", ".join(map(str, experts))
