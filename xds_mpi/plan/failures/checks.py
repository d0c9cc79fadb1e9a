"""`faults.events` checked against the deployment: every row names a die of a role its kind can
hit, the fields fit that die, and no two rows overlap (xds_mpi/config/failures.py has the kinds).

Called from `xds_mpi/plan/deployment.py` so validate, run, submit and every rank refuse the same
rows.
"""

from __future__ import annotations

from xds_mpi.config.failures import KIND_ROLES, FailureSpec
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.plan.clock import serving_clock
from xds_mpi.plan.failures.loss import (
    RELEASE_GRACES,
    _check_afd_loss,
    check_decode_loss,
    release_bound_s,
)
from xds_mpi.plan.failures.pd import OTHER_KINDS
from xds_mpi.plan.failures.pd import check_decode_loss as check_pd_decode_loss
from xds_mpi.plan.failures.rates import check_fault_rate
from xds_mpi.plan.failures.slots import afd_memory_refusal, slot_refusal
from xds_mpi.plan.topology import Topology

# (kind, role, deployment kind) the dies emulate today; any other row is refused before launch,
# so an accepted row is one that runs. Deployment kind: "colocated", "afd", or "pd" (pd.enabled).
EMULATED: set[tuple[str, str, str]] = {
    ("link", "prefill", "pd"),  # ranks/pd/channel.py, detected by ranks/recovery/link_probe.py
    ("saturated", "colocated", "pd"),
    (
        "dead",
        "prefill",
        "pd",
    ),  # ranks/pd/prefill_loss.py, detected by ranks/recovery/je_prefill_loss.py
    ("stuck", "prefill", "pd"),  # for good only (_check_prefill_loss)
    (
        "memory",
        "colocated",
        "colocated",
    ),  # KV blocks (ranks/recovery/memory.py), slots (slot_mask)
    ("memory", "colocated", "pd"),
    ("memory", "attention", "pd"),  # KV blocks, as without PD; the JE ends the victims
    # Slots: refused with the reason (slot_refusal: no ring replica on a PD run's expert dies)
    ("memory", "expert", "pd"),
    ("memory", "attention", "afd"),  # KV blocks, ranks/recovery/memory.py (afd_memory_refusal)
    ("memory", "expert", "afd"),  # slots with a ring replica
    (
        "stuck",
        "colocated",
        "colocated",
    ),  # ranks/recovery/watch.py, detected by ranks/recovery/detector.py
    ("dead", "colocated", "colocated"),
    ("stuck", "colocated", "pd"),  # for good only, ring replicas (pd.py)
    ("dead", "colocated", "pd"),  # the decode TE-shell's detector, ranks/recovery/decode_loss.py
    ("stuck", "attention", "pd"),  # for good only (_check_pd_afd_loss)
    ("dead", "attention", "pd"),  # the decode TE-shell's detector over the afd decode side
    ("stuck", "expert", "pd"),  # refused with the reason (_check_pd_afd_loss)
    ("dead", "expert", "pd"),
    (
        "stuck",
        "attention",
        "afd",
    ),  # ranks/core/decode_die.py, ranks/afd/common.py (_check_afd_loss)
    ("dead", "attention", "afd"),
    ("stuck", "expert", "afd"),  # lost: slots removed with ring replicas, else the run stops
    ("dead", "expert", "afd"),
}


def check_failures(cfg: Config, topo: Topology) -> None:
    _check_on_timeout(cfg)
    _check_at_s(cfg)
    for i, spec in enumerate(cfg.faults.events):
        _check_row(cfg, topo, f"faults.events[{i}]", spec)
    _check_overlaps(cfg.faults.events)
    if cfg.health.replicas == "ring":
        _check_ring(cfg, topo)
    for i, spec in enumerate(cfg.faults.events):
        _check_emulated(cfg, topo, f"faults.events[{i}]", spec)
        if spec.kind in ("stuck", "dead") and topo.ranks[spec.die].role != "prefill":
            _check_detectable(cfg, f"faults.events[{i}]", spec)  # a decode die's heartbeats
            if cfg.pd.enabled and cfg.deployment.kind == "afd":
                _check_pd_afd_loss(cfg, topo, f"faults.events[{i}]", spec)
            elif cfg.pd.enabled:
                check_pd_decode_loss(cfg, topo, f"faults.events[{i}]", spec)
    check_decode_loss(cfg, topo)  # xds_mpi/plan/failures/loss.py
    check_fault_rate(cfg, topo)  # faults.rate's risk (xds_mpi/plan/failures/rates.py)


def _check_at_s(cfg: Config) -> None:
    """`at_s` is a virtual time: refused unless the virtual clock drives serving."""
    timed = [i for i, e in enumerate(cfg.faults.events) if e.at_s is not None]
    if not timed:
        return
    clock = serving_clock(cfg)
    if not clock.is_virtual:
        raise ConfigError(
            f"faults.events[{timed[0]}].at_s: a fault at a virtual time needs the virtual "
            f"clock, and serving runs on the wall clock here ({clock.why}); give iteration "
            "instead"
        )


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
    if spec.kind in ("link", "saturated"):
        _check_channel(cfg, topo, where, spec)
    if role == "prefill" and spec.kind in ("dead", "stuck") and cfg.pd.enabled:
        _check_prefill_loss(cfg, where, spec)


def _check_emulated(cfg: Config, topo: Topology, where: str, spec: FailureSpec) -> None:
    role = topo.ranks[spec.die].role
    deployment = "pd" if cfg.pd.enabled else cfg.deployment.kind
    if (spec.kind, role, deployment) not in EMULATED:
        raise ConfigError(
            f"{where}: a {spec.kind} fault on a {role} die of a {deployment} deployment: "
            f"{_why_not_built(spec.kind, role, deployment)} (docs/failures.md lists the "
            "recoveries built)"
        )


def _why_not_built(kind: str, role: str, deployment: str) -> str:
    """What a (kind, role, deployment) outside EMULATED would need."""
    if kind in ("link", "saturated") and deployment != "pd":
        return "it strikes a KV transfer's path, and only PD moves KV between dies"
    if kind in ("link", "saturated"):
        return (
            "a KV path's fault names its prefill die (the sender; `peer`: the decode die), which "
            "the link prober tells apart"
        )
    if kind == "memory" and role == "prefill":
        return (
            "a prefill die hands its KV to decode within its pass; ending a memory fault's "
            "victims there would need the prefill die's block table to drop them, which is not "
            "built"
        )
    return "no recovery for it is built"


def _check_channel(cfg: Config, topo: Topology, where: str, spec: FailureSpec) -> None:
    """A KV-path fault the link prober can name (ranks/recovery/link_probe.py), and recover from."""
    health = cfg.health
    if spec.kind == "saturated" and not (
        health.probe_slow_s < spec.delay_s < health.probe_timeout_s
    ):
        raise ConfigError(
            f"{where}: a saturated die's delay_s({spec.delay_s}) must lie between "
            f"health.probe_slow_s({health.probe_slow_s}) and health.probe_timeout_s"
            f"({health.probe_timeout_s}): shorter is no fault the probe sees, longer looks "
            "like a link fault"
        )
    if spec.kind == "link" and spec.duration_s == 0 and not health.enabled:
        raise ConfigError(
            f"{where}: a link fault for good (duration_s 0) with health.enabled false: no "
            "probe would find it and its transfers would wait forever"
        )
    decode = topo.ranks_with_role("colocated") + topo.ranks_with_role("attention")
    if spec.kind == "link" and spec.duration_s == 0 and len(decode) < 2:
        raise ConfigError(
            f"{where}: a link fault for good from prefill die {spec.die} to the only decode "
            f"die {spec.peer} leaves its KV no other pair"
        )


def _check_prefill_loss(cfg: Config, where: str, spec: FailureSpec) -> None:
    """A lost prefill die takes its TE out (ranks/recovery/je_prefill_loss.py): the TE must be that
    die alone (others would hang in the TE's collectives), another TE must be left, and someone must
    be listening."""
    dies, tes = cfg.deployment.num_prefill_dies, cfg.pd.num_prefill_tes
    if spec.kind == "stuck" and spec.duration_s:
        raise ConfigError(
            f"{where}: a prefill die stuck for duration_s({spec.duration_s}) comes back, and the "
            "JE's prefill-TE loss has no path for a TE that returns (it is taken out for good); "
            "only stuck for good (duration_s 0)"
        )
    if dies != tes:
        raise ConfigError(
            f"{where}: losing prefill die {spec.die} is emulated only with one die per prefill "
            f"TE (deployment.num_prefill_dies({dies}) = pd.num_prefill_tes({tes})): the other "
            "dies of its TE would hang in the TE's collectives"
        )
    if tes < 2 or not cfg.health.enabled:
        raise ConfigError(
            f"{where}: losing prefill die {spec.die} needs another prefill TE (pd.num_prefill_"
            f"tes {tes}) and health.enabled({cfg.health.enabled}) to find it"
        )


def _check_pd_afd_loss(cfg: Config, topo: Topology, where: str, spec: FailureSpec) -> None:
    """A die of a PD run's afd decode side lost (ranks/recovery/decode_loss.py): the decode
    TE-shell watches the attention and expert dies as the afd TE-shell does without PD, the
    attention die's DP domain goes on with the attention dies it has left, and the JE has its
    requests prefilled again or re-routed (ranks/recovery/je_decode_loss.py)."""
    info = topo.ranks[spec.die]
    if info.role == "expert":
        raise ConfigError(
            f"{where}: losing expert die {spec.die} of a PD run's afd decode side is not built: "
            "its experts live on it alone, and it would need health.replicas=ring placed on a "
            "PD run's afd expert dies (xds_mpi/eplb/ring.py fills them without PD only) or a PD "
            "run that stops naming the experts (health.on_expert_lost=stop, which the JE's stop "
            "path does not take); lose an attention die instead"
        )
    if cfg.deployment.num_host_ranks != 2:
        raise ConfigError(
            f"{where}: a lost attention die of a PD run is found by the decode TE-shell (host "
            f"rank 1); deployment.num_host_ranks({cfg.deployment.num_host_ranks}) gives the JE "
            "the decode balancing and nobody watches the decode dies"
        )
    if spec.kind == "stuck" and spec.duration_s:
        raise ConfigError(
            f"{where}: an attention die of a PD run stuck for duration_s({spec.duration_s}) is "
            "not built, as for a colocated PD decode die: a die that comes back (a transient, "
            "or after the fence: a failover that loses no die) is not handled by the decode "
            "TE-shell's failover nor priced by its pacer on the virtual clock; only stuck for "
            "good (duration_s 0)"
        )
    others = [i for i, e in enumerate(cfg.faults.events) if e.kind in OTHER_KINDS and e is not spec]
    if others:
        raise ConfigError(
            f"{where}: a lost attention die of a PD run with other fault rows "
            f"(faults.events{others}): one stuck/dead decode row per run, as with colocated "
            "decode dies (xds_mpi/plan/failures/pd.py)"
        )
    bound = release_bound_s(cfg.health)
    if cfg.health.probe_timeout_s <= bound:
        raise ConfigError(
            f"{where}: health.probe_timeout_s({cfg.health.probe_timeout_s:g}) must exceed "
            f"detection and release ({bound:g} s): until the fence releases them the surviving "
            "attention dies wait for the lost one and echo no link probe, and the prefill dies "
            "would call their pairs down (false link verdicts)"
        )
    _check_afd_loss(topo, cfg.faults.events)  # its DP domain keeps another attention die


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
            "remaining dies) would relaunch the decode processes into a new layout, which a "
            "fixed MPI world cannot do; use stop"
        )
    grace, needed = health.release_grace_s, release_bound_s(health)
    # faults.on_timeout=recompute: a timed-out wait is recomputed, and the vote after it waits
    # out detection and release (ranks/recovery/recompute.py), so a short poll timeout is fine.
    if cfg.xccl.poll_timeout_s <= needed and cfg.faults.on_timeout != "recompute":
        raise ConfigError(
            f"{where}: xccl.poll_timeout_s({cfg.xccl.poll_timeout_s:g}) must exceed detection "
            f"and release, health.timeout_s({health.timeout_s:g}) + dp_interval_s"
            f"({health.dp_interval_s:g}) + {RELEASE_GRACES} x {grace:g} s = {needed:g} s: the "
            "stuck die's peers would end the run with an XCCL timeout first (or set "
            "faults.on_timeout=recompute)"
        )


def _check_on_timeout(cfg: Config) -> None:
    """faults.on_timeout=recompute runs on colocated and afd decode dies
    (ranks/recovery/recompute.py),
    which need the heartbeats to tell a lost peer from a slow one."""
    if cfg.faults.on_timeout != "recompute":
        return
    kind, pd, eplb, health = (
        cfg.deployment.kind,
        cfg.pd.enabled,
        cfg.eplb.enabled,
        cfg.health.enabled,
    )
    if kind not in ("colocated", "afd") or pd or eplb or not health:
        raise ConfigError(
            "faults.on_timeout=recompute is emulated on the dies of a colocated or afd deployment "
            f"without PD or EPLB and with heartbeats (deployment.kind {kind}, pd.enabled {pd}, "
            f"eplb.enabled {eplb}, health.enabled {health}): without heartbeats a lost peer "
            "would look like a slow one; EPLB's waits for the TE-shell are not recomputed"
        )


def _check_ring(cfg: Config, topo: Topology) -> None:
    """health.replicas=ring (xds_mpi/eplb/ring.py): each routed die's redundant slots (colocated
    dies, or afd expert dies, or a PD run's colocated decode dies) take the next routed die's
    experts, from the start and for good; with EPLB (colocated without PD) those slots stay put
    and EPLB fills the ones left over."""
    kind, pd = cfg.deployment.kind, cfg.pd.enabled
    if kind not in ("colocated", "afd") or (pd and kind != "colocated"):
        raise ConfigError(
            "health.replicas=ring fills the redundant slots of a colocated or afd deployment, "
            f"or of a PD run's colocated decode dies (deployment.kind {kind}, pd.enabled {pd})"
        )
    if pd and cfg.eplb.enabled:
        raise ConfigError(
            "health.replicas=ring with eplb.enabled in a PD run: vertical scaling with EPLB is "
            "emulated without PD only"
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
    if cfg.deployment.kind == "afd" and (refusal := afd_memory_refusal(cfg, where, spec)):
        raise ConfigError(refusal)  # xds_mpi/plan/failures/slots.py
    if spec.slot >= 0:
        slots = topo.ranks[spec.die].expert_slots
        if spec.slot >= len(slots):
            raise ConfigError(
                f"{where}.slot({spec.slot}): rank {spec.die} ({role}) has {len(slots)} expert slots"
            )
        refusal = slot_refusal(cfg, topo, where, spec)  # xds_mpi/plan/failures/slots.py
        if refusal:
            raise ConfigError(refusal)
        return
    if role == "expert":
        raise ConfigError(f"{where}: rank {spec.die} is an expert die and holds no KV blocks")
    blocks = cfg.scheduler.num_kv_blocks_per_die
    if spec.first_block + spec.num_blocks > blocks:
        raise ConfigError(
            f"{where}: KV blocks {spec.first_block}..{spec.first_block + spec.num_blocks - 1} "
            f"are past the die's scheduler.num_kv_blocks_per_die({blocks})"
        )
    masked = sum(
        e.num_blocks for e in cfg.faults.events if e.kind == "memory" and e.die == spec.die
    )
    w = cfg.workload
    tokens = max(w.prompt_len, w.max_prompt_len) + max(w.output_len, w.max_output_len)
    tokens = min(tokens + cfg.scheduler.mtp_depth, cfg.model.max_seq_len)
    longest = -(-tokens // cfg.scheduler.kv_block_tokens)
    if blocks - masked < longest:
        raise ConfigError(
            f"{where}: die {spec.die} keeps {blocks} - {masked} masked = {blocks - masked} KV "
            f"blocks, fewer than the {longest} the workload's longest request ({tokens} tokens) "
            "may need: it would wait forever"
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
