"""Topology: which rank plays which die, role, DP domain/group and expert slots.

Rank order: the host ranks (TE-shell) first, then the dies, then the EMS pool ranks (`ems.enabled`:
no die, their windows stand for CPU DRAM; docs/ems.md). Dies are numbered from 0 in this
order: attention (or colocated) dies domain by domain, then expert dies (afd), then prefill dies.
Die `d` sits at server `d // dies_per_server`, chip `(d % dies_per_server) // dies_per_chip`,
die-in-chip `d % dies_per_chip`, so a server's dies are consecutive ranks.

Expert placement (static; EPLB later fills the redundant slots and remaps log2phy):
- the expert-hosting dies are every die of a colocated deployment, or the expert dies of an afd one;
- with `shared_experts: dedicated` the last `num_shared_expert_dies` of them hold one shared expert
  each (EP288 style), the others hold routed experts; with `every_die` every hosting die also holds
  a copy of each shared expert;
- routed experts go to the routed dies in contiguous chunks whose sizes differ by at most one;
- each routed die reserves `redundant_slots_per_die` empty replica slots (expert_idx = -1).
Physical slot ids number all routed + redundant slots in die order; `phy2log` maps them back.

Trampolines (afd): the attention die of DP group g (within its domain) sends A2E to expert die g;
expert dies 0..G-1 are the trampolines, one per attention die of a domain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.schema import Config, ConfigError

Role = Literal["host", "attention", "expert", "colocated", "prefill", "pool"]
SlotKind = Literal["routed", "shared", "redundant"]


@dataclass(frozen=True, kw_only=True)
class ExpertSlot:
    """One expert a die hosts.

    kind: routed | shared | redundant.
    expert_idx: logical routed expert (routed, redundant) or shared expert index; -1 = empty slot.
    phy_idx: global physical slot id of routed and redundant slots; -1 for shared slots.
    """

    kind: SlotKind
    expert_idx: int
    phy_idx: int


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Everything a rank needs to know about itself. Fields that do not apply are -1 / empty."""

    rank: int
    role: Role
    die_idx: int = -1
    server: int = -1
    chip: int = -1
    die_in_chip: int = -1
    dp_domain: int = -1
    dp_group: int = -1  # global DP group id = dp_domain * G + group-in-domain
    expert_slots: tuple[ExpertSlot, ...] = ()
    trampoline_for: int = -1  # afd: the group-in-domain whose attention dies it serves

    @property
    def is_die(self) -> bool:
        return self.role not in ("host", "pool")

    @property
    def is_trampoline(self) -> bool:
        return self.trampoline_for >= 0


@dataclass(frozen=True, kw_only=True)
class Topology:
    world_size: int
    num_host_ranks: int
    num_dies: int
    dp_groups_per_domain: int
    num_dp_domains: int
    ranks: tuple[RankInfo, ...]
    phy2log: tuple[int, ...]  # [num_phy_slots] logical routed expert, -1 = empty

    @staticmethod
    def dies_needed(cfg: Config) -> dict[str, int]:
        """Dies per role the config asks for (no rank needed)."""
        dep = cfg.deployment
        if dep.kind == "colocated":
            counts = {"colocated": dep.num_attention_dies}
        else:
            counts = {"attention": dep.num_attention_dies, "expert": dep.num_expert_dies}
        counts["prefill"] = dep.num_prefill_dies
        return counts

    @staticmethod
    def pool_ranks_needed(cfg: Config) -> int:
        """EMS pool ranks (no die; docs/ems.md): after the dies."""
        return cfg.ems.servers if cfg.ems.enabled else 0

    @staticmethod
    def world_size_needed(cfg: Config) -> int:
        dies = sum(Topology.dies_needed(cfg).values())
        return cfg.deployment.num_host_ranks + dies + Topology.pool_ranks_needed(cfg)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int | None = None) -> Topology:
        dep = cfg.deployment
        counts = cls.dies_needed(cfg)
        _refuse_misfit(cfg, counts, world_size)
        roles: list[Role] = [role for role, n in counts.items() for _ in range(n)]
        slots_of, phy2log = _place_experts(cfg, roles)
        ranks = [RankInfo(rank=r, role="host") for r in range(dep.num_host_ranks)]
        ranks += [
            _die_info(cfg, counts, die_idx, role, slots_of.get(die_idx, ()))
            for die_idx, role in enumerate(roles)
        ]
        first_pool = dep.num_host_ranks + len(roles)
        num_pool = cls.pool_ranks_needed(cfg)
        ranks += [RankInfo(rank=first_pool + i, role="pool") for i in range(num_pool)]
        return cls(
            world_size=first_pool + num_pool,
            num_host_ranks=dep.num_host_ranks,
            num_dies=len(roles),
            dp_groups_per_domain=dep.dp_groups_per_domain,
            num_dp_domains=dep.num_dp_domains,
            ranks=tuple(ranks),
            phy2log=tuple(phy2log),
        )

    def summary(self) -> str:
        """One line: world size, dies per role, servers spanned."""
        counts: dict[str, int] = {}
        for info in self.ranks:
            counts[info.role] = counts.get(info.role, 0) + 1
        roles = ", ".join(f"{n} {role}" for role, n in counts.items())
        num_servers = max((info.server for info in self.ranks), default=-1) + 1
        return (
            f"world size {self.world_size}: {roles}; {self.num_dies} dies on "
            f"{num_servers} server(s); {self.num_dp_domains} DP domain(s) x "
            f"{self.dp_groups_per_domain} DP group(s)"
        )

    def ranks_with_role(self, role: Role) -> tuple[int, ...]:
        return tuple(info.rank for info in self.ranks if info.role == role)

    @property
    def die_ranks(self) -> tuple[int, ...]:
        return tuple(info.rank for info in self.ranks if info.is_die)

    def domain_ranks(self, dp_domain: int) -> tuple[int, ...]:
        """Attention (or colocated) ranks of one DP domain, in DP-group order."""
        return tuple(info.rank for info in self.ranks if info.dp_domain == dp_domain)

    def trampoline_rank(self, rank: int) -> int:
        """The expert die an attention rank sends its A2E to."""
        info = self.ranks[rank]
        if info.role != "attention":
            raise ValueError(
                f"rank {rank} is a {info.role} rank; only attention ranks have a trampoline"
            )
        group_in_domain = info.dp_group % self.dp_groups_per_domain
        return next(r.rank for r in self.ranks if r.trampoline_for == group_in_domain)

    def log2phy(self) -> tuple[tuple[int, ...], ...]:
        """[num_routed_experts] -> physical slots holding that expert (replicas included)."""
        num_experts = max(self.phy2log, default=-1) + 1
        table: list[list[int]] = [[] for _ in range(num_experts)]
        for phy_idx, expert_idx in enumerate(self.phy2log):
            if expert_idx >= 0:
                table[expert_idx].append(phy_idx)
        return tuple(tuple(slots) for slots in table)


def _refuse_misfit(cfg: Config, counts: dict[str, int], world_size: int | None) -> None:
    """Refuse a launch whose world size is not the config's ranks, or dies that overflow a pod."""
    dep, hw = cfg.deployment, cfg.hardware
    num_dies = sum(counts.values())
    num_pool = Topology.pool_ranks_needed(cfg)
    needed = dep.num_host_ranks + num_dies + num_pool
    if world_size is not None and world_size != needed:
        parts = " + ".join(f"{role} dies({n})" for role, n in counts.items() if n)
        parts += f" + ems pool ranks({num_pool})" if num_pool else ""
        raise ConfigError(
            f"world size {world_size} != num_host_ranks({dep.num_host_ranks}) + {parts} = {needed}"
        )
    if num_dies > hw.dies_per_pod:
        raise ConfigError(
            f"{num_dies} dies do not fit in one pod of {hw.dies_per_pod} dies "
            f"({hw.servers_per_pod} servers x {hw.chips_per_server} chips x "
            f"{hw.dies_per_chip} dies)"
        )


def _die_info(
    cfg: Config,
    counts: dict[str, int],
    die_idx: int,
    role: Role,
    expert_slots: tuple[ExpertSlot, ...],
) -> RankInfo:
    """Die `die_idx`: where it sits in the pod, its DP domain and group (attention, colocated)
    or the group-in-domain it is the trampoline for (the first G expert dies)."""
    dep, hw = cfg.deployment, cfg.hardware
    num_groups = dep.dp_groups_per_domain
    server, in_server = divmod(die_idx, hw.dies_per_server)
    domain = group = trampoline_for = -1
    if role in ("attention", "colocated"):
        domain, group = die_idx // num_groups, die_idx
    if role == "expert":
        expert_no = die_idx - counts.get("attention", 0)
        trampoline_for = expert_no if expert_no < num_groups else -1
    return RankInfo(
        rank=dep.num_host_ranks + die_idx,
        role=role,
        die_idx=die_idx,
        server=server,
        chip=in_server // hw.dies_per_chip,
        die_in_chip=in_server % hw.dies_per_chip,
        dp_domain=domain,
        dp_group=group,
        expert_slots=expert_slots,
        trampoline_for=trampoline_for,
    )


def _routed_dies(cfg: Config, hosts: list[int]) -> list[int]:
    """The expert-hosting dies that take routed experts (the last num_shared_expert_dies hold a
    shared expert instead), refused when the routed experts cannot fill or fit them."""
    dep, model = cfg.deployment, cfg.model
    num_shared_dies = dep.num_shared_expert_dies
    if num_shared_dies and model.num_shared_experts == 0:
        raise ConfigError(
            f"deployment.num_shared_expert_dies({num_shared_dies}) > 0 but "
            "model.num_shared_experts is 0"
        )
    if num_shared_dies >= len(hosts):
        raise ConfigError(
            f"deployment.num_shared_expert_dies({num_shared_dies}) leaves no die for "
            f"routed experts: only {len(hosts)} expert-hosting dies"
        )
    routed_dies = hosts[: len(hosts) - num_shared_dies]
    num_experts, num_routed_dies = model.num_routed_experts, len(routed_dies)
    if num_routed_dies > num_experts:
        raise ConfigError(
            f"{num_routed_dies} routed-expert dies > model.num_routed_experts"
            f"({num_experts}): {num_routed_dies - num_experts} dies would host no "
            "expert; use fewer dies, more experts, or dedicated shared-expert dies"
        )
    per_die = -(-num_experts // num_routed_dies)
    if per_die > dep.max_routed_experts_per_die:
        raise ConfigError(
            f"model.num_routed_experts({num_experts}) do not fit into "
            f"{num_routed_dies} routed-expert dies x max_routed_experts_per_die"
            f"({dep.max_routed_experts_per_die}) = "
            f"{num_routed_dies * dep.max_routed_experts_per_die} slots"
        )
    return routed_dies


def _place_experts(
    cfg: Config, roles: list[Role]
) -> tuple[dict[int, tuple[ExpertSlot, ...]], list[int]]:
    dep, model = cfg.deployment, cfg.model
    hosts = [d for d, role in enumerate(roles) if role in ("colocated", "expert")]
    routed_dies = _routed_dies(cfg, hosts)
    slots_of: dict[int, tuple[ExpertSlot, ...]] = {}
    phy2log: list[int] = []
    base, extra = divmod(model.num_routed_experts, len(routed_dies))
    first = 0
    for i, die in enumerate(routed_dies):
        count = base + (1 if i < extra else 0)
        slots = []
        for expert_idx in range(first, first + count):
            slots.append(ExpertSlot(kind="routed", expert_idx=expert_idx, phy_idx=len(phy2log)))
            phy2log.append(expert_idx)
        for _ in range(dep.redundant_slots_per_die):
            slots.append(ExpertSlot(kind="redundant", expert_idx=-1, phy_idx=len(phy2log)))
            phy2log.append(-1)
        if dep.shared_experts == "every_die":
            slots += [
                ExpertSlot(kind="shared", expert_idx=s, phy_idx=-1)
                for s in range(model.num_shared_experts)
            ]
        slots_of[die] = tuple(slots)
        first += count
    for i, die in enumerate(hosts[len(routed_dies) :]):
        slots_of[die] = (
            ExpertSlot(kind="shared", expert_idx=i % model.num_shared_experts, phy_idx=-1),
        )
    return slots_of, phy2log
