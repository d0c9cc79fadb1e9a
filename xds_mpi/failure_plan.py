"""`faults.events` checked against the deployment: every row names a die of a role its kind can
hit, the fields fit that die, and no two rows overlap (xds_mpi/config_failures.py has the kinds).

Called from `xds_mpi/plan.py` so validate, run, submit and every rank refuse the same rows.
"""

from __future__ import annotations

from xds_mpi.config import Config, ConfigError
from xds_mpi.config_failures import KIND_ROLES, FailureSpec
from xds_mpi.topology import Topology

# (kind, role, deployment kind) the dies emulate today; any other row is refused before launch,
# so an accepted row is one that runs. Deployment kind: "colocated", "afd", or "pd" (pd.enabled).
EMULATED: set[tuple[str, str, str]] = {
    ("stuck", "colocated", "colocated"),  # ranks/die_health.py, detected by ranks/detector.py
    ("dead", "colocated", "colocated"),
}
# Seconds the TE-shell's release takes at most after detection (ranks/detector.py): two graces.
RELEASE_GRACES = 2


def check_failures(cfg: Config, topo: Topology) -> None:
    for i, spec in enumerate(cfg.faults.events):
        _check_row(cfg, topo, f"faults.events[{i}]", spec)
    _check_overlaps(cfg.faults.events)
    if cfg.health.replicas == "ring":
        _check_ring(cfg, topo)
    for i, spec in enumerate(cfg.faults.events):
        _check_emulated(cfg, topo, f"faults.events[{i}]", spec)
        if spec.kind in ("stuck", "dead"):
            _check_detectable(cfg, f"faults.events[{i}]", spec)


def _check_row(cfg: Config, topo: Topology, where: str, spec: FailureSpec) -> None:
    roles = {info.rank: info.role for info in topo.ranks if info.is_die}
    if spec.die not in roles:
        raise ConfigError(
            f"{where}.die({spec.die}) is not a die: dies are ranks {min(roles)}..{max(roles)}"
        )
    role, allowed = roles[spec.die], KIND_ROLES[spec.kind]
    if role not in allowed:
        raise ConfigError(
            f"{where}: a {spec.kind} fault hits a {' or '.join(allowed)} die; "
            f"rank {spec.die} is a {role} die"
        )
    if spec.kind in ("link", "saturated") and not cfg.pd.enabled:
        raise ConfigError(
            f"{where}: a {spec.kind} fault is on the KV-transfer path, which only a "
            "disaggregated prefill-decode run has (pd.enabled is false)"
        )
    if spec.kind == "link" and roles.get(spec.peer) not in ("colocated", "attention"):
        raise ConfigError(
            f"{where}.peer({spec.peer}) is not a decode die (a link joins prefill die "
            f"{spec.die} to a colocated or attention die)"
        )
    if spec.kind == "memory":
        _check_memory(cfg, topo, where, spec, role)


def _check_emulated(cfg: Config, topo: Topology, where: str, spec: FailureSpec) -> None:
    role = topo.ranks[spec.die].role
    deployment = "pd" if cfg.pd.enabled else cfg.deployment.kind
    if (spec.kind, role, deployment) not in EMULATED:
        raise ConfigError(
            f"{where}: a {spec.kind} fault on a {role} die of a {deployment} deployment is not "
            "emulated (README.md, Failures, lists what is)"
        )


def _check_detectable(cfg: Config, where: str, spec: FailureSpec) -> None:
    """A stuck or dead die is found by the heartbeats; its peers wait for it meanwhile, and their
    waits must outlast detection and release, or they fail with an XCCL timeout first."""
    health = cfg.health
    if not health.enabled:
        raise ConfigError(
            f"{where}: a {spec.kind} fault is found by heartbeats, and health.enabled is false"
        )
    if health.on_expert_lost == "restart":
        raise ConfigError(
            f"{where}: health.on_expert_lost=restart (stage 1: rebuild the decode side on the "
            "remaining dies) is not emulated; use stop"
        )
    grace = health.release_grace_s
    needed = health.timeout_s + health.dp_interval_s + RELEASE_GRACES * grace
    if cfg.xccl.poll_timeout_s <= needed:
        raise ConfigError(
            f"{where}: xccl.poll_timeout_s({cfg.xccl.poll_timeout_s:g}) must exceed detection "
            f"and release, health.timeout_s({health.timeout_s:g}) + dp_interval_s"
            f"({health.dp_interval_s:g}) + {RELEASE_GRACES} x {grace:g} s = {needed:g} s: the "
            "stuck die's peers would end the run with an XCCL timeout first"
        )


def _check_ring(cfg: Config, topo: Topology) -> None:
    """health.replicas=ring (ranks/replicas.py): each routed die's redundant slots take the next
    routed die's experts, from the start and for good."""
    if cfg.deployment.kind != "colocated" or cfg.pd.enabled or cfg.eplb.enabled:
        raise ConfigError(
            "health.replicas=ring fills the redundant slots of a colocated deployment without "
            f"PD or EPLB (deployment.kind {cfg.deployment.kind}, pd.enabled {cfg.pd.enabled}, "
            f"eplb.enabled {cfg.eplb.enabled}): EPLB would move the replicas"
        )
    routed = [
        sum(1 for s in info.expert_slots if s.kind == "routed")
        for info in topo.ranks
        if any(s.kind == "routed" for s in info.expert_slots)
    ]
    redundant = cfg.deployment.redundant_slots_per_die
    if redundant < max(routed):
        raise ConfigError(
            f"health.replicas=ring copies each die's {max(routed)} routed experts into the "
            f"previous die's redundant slots: deployment.redundant_slots_per_die({redundant}) "
            f"must be >= {max(routed)}"
        )


def _check_memory(cfg: Config, topo: Topology, where: str, spec: FailureSpec, role: str) -> None:
    if spec.slot >= 0:
        slots = topo.ranks[spec.die].expert_slots
        if spec.slot >= len(slots):
            raise ConfigError(
                f"{where}.slot({spec.slot}): rank {spec.die} ({role}) has {len(slots)} expert slots"
            )
        return
    if role == "expert":
        raise ConfigError(f"{where}: rank {spec.die} is an expert die and holds no KV blocks")
    blocks = cfg.scheduler.num_kv_blocks_per_die
    if spec.first_block + spec.num_blocks > blocks:
        raise ConfigError(
            f"{where}: KV blocks {spec.first_block}..{spec.first_block + spec.num_blocks - 1} "
            f"are past the die's scheduler.num_kv_blocks_per_die({blocks})"
        )


def _check_overlaps(events: list[FailureSpec]) -> None:
    """A dead die takes no other fault; one die has one fault of a kind (two memory rows: ranges
    that do not overlap), so what was injected and what was detected stay one-to-one."""
    for i, a in enumerate(events):
        for j in range(i):
            b = events[j]
            if a.die != b.die:
                continue
            if "dead" in (a.kind, b.kind) or (a.kind == b.kind and _overlap(a, b)):
                raise ConfigError(
                    f"faults.events[{j}] ({b.kind}) and faults.events[{i}] ({a.kind}) overlap "
                    f"on die {a.die}: a dead die takes no other fault, and one die takes one "
                    "fault of each kind (memory: ranges that do not overlap)"
                )


def _overlap(a: FailureSpec, b: FailureSpec) -> bool:
    if a.kind != "memory":
        return True
    if a.slot >= 0 or b.slot >= 0:
        return a.slot == b.slot
    a_end, b_end = a.first_block + a.num_blocks, b.first_block + b.num_blocks
    return a.first_block < b_end and b.first_block < a_end
