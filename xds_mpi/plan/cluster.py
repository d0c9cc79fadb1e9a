"""The topology of a cluster (`cluster.num_tes` > 1, docs/cluster.md): world rank 0 is the job
executor (JE; with `cluster.num_jes` J > 1 JEs, world ranks 0..J-1), then the TEs one after
another, each [its TE-shell, its dies] exactly as the rest
of the config describes one deployment. Each TE runs on a communicator of its own, its ranks
renumbered 0..S-1 (TE-shell 0) as if it were the world, so its windows, scheduler, KV,
agreement and failure handling are one TE's; the JEs and the TE-shells share a second one (the
link: JE j at j, TE-shell of TE k at J + k).

`cluster.groups` makes TEs of different kinds and shapes: each group's TEs have the rest of the
config with the group's `--set` values. A `pool` group's TEs launch their TE-shell only; their
dies are taken from `cluster.pool`, world ranks after every TE, at each scale-out (docs/cluster.md
"A pool of ranks"). A PD pair is one TE whose TE-shell is the pair's own JE
(ranks/cluster/pd_side.py). What a cluster does not support yet is refused, naming the key.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xds_mpi.config.cluster import TeGroup
from xds_mpi.config.schema import Config, ConfigError, config_from_dict

JE_RANK = 0  # the (first) JE's world rank, and its rank on the link: it writes the run file


@dataclass(frozen=True, kw_only=True)
class TeInfo:
    """One TE of a cluster: te: its index; first_rank: its TE-shell's world rank; size: its
    ranks; kind: "colocated", "afd" or "pd" (a PD pair: its JE is its TE-shell); num_dies;
    group: the name of its group; overrides: its group's `--set` values on the config; standby:
    it starts in standby (serves once the autoscaler scales out to it); is_pool: only its
    TE-shell is launched at first_rank, its dies are pool ranks taken at each scale-out."""

    te: int
    first_rank: int
    size: int
    kind: str
    num_dies: int
    group: str
    overrides: tuple[str, ...] = ()
    standby: bool = False
    is_pool: bool = False

    @property
    def num_launched(self) -> int:
        """Its ranks launched as its own: a pool TE's host ranks only (its TE-shell; a PD
        pair's JE and decode TE-shell)."""
        return self.size - self.num_dies if self.is_pool else self.size


@dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    """The TEs behind the JEs, one after another from world rank num_jes; policy:
    cluster.policy; num_jes: the JEs, world ranks (and link ranks) 0..num_jes-1; pool_ranks:
    the world ranks after the TEs that the pool TEs' dies are taken from (cluster.pool)."""

    tes: tuple[TeInfo, ...]
    policy: str
    num_jes: int = 1
    pool_ranks: tuple[int, ...] = ()

    @property
    def num_tes(self) -> int:
        return len(self.tes)

    @property
    def world_size(self) -> int:
        return self.num_jes + sum(t.num_launched for t in self.tes) + len(self.pool_ranks)

    def is_pool_rank(self, world_rank: int) -> bool:
        return world_rank in self.pool_ranks

    @property
    def pool_hosts(self) -> tuple[int, ...]:
        """The world ranks of the pool TEs' host ranks off the link (a PD pair's decode
        TE-shell), which wait for their TE's activation as pool ranks do."""
        return tuple(
            rank
            for t in self.tes
            if t.is_pool
            for rank in range(t.first_rank + 1, t.first_rank + t.num_launched)
        )

    def shell(self, te: int) -> int:
        """TE `te`'s TE-shell's rank on the link (the JEs first)."""
        return self.num_jes + te

    def first_rank(self, te: int) -> int:
        """The world rank of TE `te`'s TE-shell (its rank 0)."""
        return self.tes[te].first_rank

    def te_of(self, world_rank: int) -> tuple[int, int]:
        """(TE, rank inside it) of a world rank; (-1, 0) for a JE."""
        for t in self.tes:
            if t.first_rank <= world_rank < t.first_rank + t.num_launched:
                return t.te, world_rank - t.first_rank
        return -1, 0

    def describe(self) -> str:
        """validate's lines: the JE and each TE's world ranks."""
        kinds = Counter(f"{t.size}-rank {t.kind}" for t in self.tes)
        lines = [
            f"cluster: {self.num_tes} TEs ({', '.join(f'{n} x {k}' for k, n in kinds.items())}) "
            f"behind {self._jes()}, policy {self.policy}, world size {self.world_size}",
            f"  JE: world rank {JE_RANK}"
            if self.num_jes == 1
            else f"  JEs: world ranks 0..{self.num_jes - 1} (the requests dealt in arrival order)",
        ]
        for t in self.tes:
            first, last = t.first_rank, t.first_rank + t.size - 1
            shell = "JE of the pair" if t.kind == "pd" else "TE-shell"
            name = t.kind if t.group == t.kind else f"{t.group}: {t.kind}"
            name += ", standby" if t.standby else ""
            name += ", pool" if t.is_pool else ""
            ranks = f"world ranks {first}..{last} ({shell} {first}"
            if t.is_pool:
                hosts = (
                    f"rank {first}"
                    if t.num_launched == 1
                    else (f"ranks {first}..{first + t.num_launched - 1}")
                )
                ranks = f"world {hosts} ({shell} {first}; its dies from the pool at scale-out"
            lines.append(
                f"  TE {t.te} ({name}, {t.num_dies} dies): {ranks}; ranks 0..{t.size - 1} "
                "inside the TE)"
            )
        if self.pool_ranks:
            lines.append(
                f"  pool: world ranks {self.pool_ranks[0]}..{self.pool_ranks[-1]} "
                f"({len(self.pool_ranks)} ranks, no TE at launch)"
            )
        return "\n".join(lines)

    def _jes(self) -> str:
        return "one JE" if self.num_jes == 1 else f"{self.num_jes} JEs"


def te_config(cfg: Config, overrides: tuple[str, ...]) -> Config:
    """The config of a TE whose group sets `overrides` on the rest of the config."""
    if not overrides:
        return cfg
    return config_from_dict(cfg.to_dict(), list(overrides))


def plan_cluster(cfg: Config) -> ClusterPlan | None:
    """The cluster's TEs (None: cluster.num_tes 1, one TE); each TE's config checked for what a
    cluster TE needs, naming its group."""
    # Lazy imports: a cluster's plan only (the topology imports this module's caller).
    from xds_mpi.plan.clock import serving_clock
    from xds_mpi.plan.topology import Topology

    section = cfg.cluster
    if section.num_tes == 1 and section.num_jes > 1:
        raise ConfigError(
            f"cluster.num_jes({section.num_jes}) > 1 needs a cluster of TEs (cluster.num_tes > 1 "
            "or cluster.groups): one TE has no JE"
        )
    if section.num_tes == 1:
        if cfg.autoscaler.enabled:
            raise ConfigError(
                "autoscaler.enabled needs a cluster (cluster.groups with a standby group) to scale"
            )
        return None
    groups = section.groups or [TeGroup(count=section.num_tes)]
    tes, first = [], section.num_jes
    for index, group in enumerate(groups):
        overrides = tuple(group.set)
        where = f"cluster.groups[{index}]" if section.groups else "the config"
        try:
            te_cfg = te_config(cfg, overrides)
            check_cluster(te_cfg, clock=serving_clock(te_cfg))
            topo = Topology.from_config(te_cfg, None)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        kind = "pd" if te_cfg.pd.enabled else te_cfg.deployment.kind
        for _ in range(group.count):
            tes.append(
                TeInfo(
                    te=len(tes),
                    first_rank=first,
                    size=topo.world_size,
                    kind=kind,
                    num_dies=topo.num_dies,
                    group=group.name or kind,
                    overrides=overrides,
                    standby=group.standby,
                    is_pool=group.pool,
                )
            )
            first += tes[-1].num_launched
    check_scaling(cfg, tes)
    check_pool(cfg, tes)
    pool_ranks = tuple(range(first, first + section.pool))
    return ClusterPlan(
        tes=tuple(tes), policy=section.policy, num_jes=section.num_jes, pool_ranks=pool_ranks
    )


def check_pool(cfg: Config, tes: list[TeInfo]) -> None:
    """A pool TE needs a pool that holds its dies (docs/cluster.md "A pool of ranks"); pool TEs
    of different shapes may share a pool smaller than their total (they take turns). What a
    pool TE's dies do not support yet is refused, naming its group."""
    pool, pool_tes = cfg.cluster.pool, [t for t in tes if t.is_pool]
    if pool_tes and pool == 0:
        names = sorted({t.group for t in pool_tes})
        raise ConfigError(
            f"cluster.groups {names} say pool: true but cluster.pool is 0: their dies come from "
            "the pool; set cluster.pool to at least "
            f"{max(t.num_dies for t in pool_tes)} (the largest pool TE's dies)"
        )
    if pool and not pool_tes:
        raise ConfigError(
            f"cluster.pool({pool}) ranks but no cluster.groups row says pool: true: they would "
            "serve no TE; set cluster.pool=0 or add a pool group"
        )
    largest = max(pool_tes, key=lambda t: t.num_dies, default=None)
    if largest is not None and pool < largest.num_dies:
        raise ConfigError(
            f"cluster.pool({pool}) is smaller than the {largest.num_dies} dies of cluster TE "
            f"{largest.te} (group {largest.group}, pool): it could never scale out; set "
            f"cluster.pool >= {largest.num_dies}"
        )
    for t in pool_tes:
        where = f"cluster TE {t.te} (group {t.group}, pool)"
        if t.kind not in ("colocated", "pd"):
            raise ConfigError(
                f"{where}: its kind is {t.kind}, but a pool TE is built for colocated TEs and "
                "PD pairs only; make the group colocated or a PD pair, or not pool"
            )


def check_scaling(cfg: Config, tes: list[TeInfo]) -> None:
    """Standby TEs and the autoscaler go together, within the TEs there are."""
    standby = [t.te for t in tes if t.standby]
    scaler = cfg.autoscaler
    if standby and not scaler.enabled:
        raise ConfigError(
            f"cluster TEs {standby} are standby (cluster.groups standby true) but "
            "autoscaler.enabled is false: they would never serve"
        )
    if scaler.enabled and not standby:
        raise ConfigError(
            "autoscaler.enabled needs standby TEs to scale out to: a cluster.groups row with "
            "standby: true"
        )
    if scaler.enabled and len(standby) == len(tes):
        raise ConfigError("every cluster TE is standby: none serves the first requests")
    if scaler.enabled and cfg.cluster.num_jes > 1:
        raise ConfigError(
            f"autoscaler.enabled with cluster.num_jes({cfg.cluster.num_jes}) > 1 is not built "
            "yet: the autoscaler acts on one JE's view of the loads; set cluster.num_jes=1"
        )
    if scaler.enabled and max(scaler.max_tes, scaler.min_tes) > len(tes):
        serving = len(tes) - len(standby)
        raise ConfigError(
            f"autoscaler.max_tes({scaler.max_tes}) / min_tes({scaler.min_tes}) asks more TEs "
            f"than the cluster has: {len(tes)} ({serving} serving from the start + "
            f"{len(standby)} standby); add standby TEs (a cluster.groups row with standby: "
            f"true) or set max_tes at most {len(tes)} (0: all)"
        )
    for te in standby:
        check_standby(cfg, tes, tes[te])


def check_standby(cfg: Config, tes: list[TeInfo], te: TeInfo) -> None:
    """A standby TE's dies load the weights at its scale-out (docs/scaling.md, "Weights at
    scale-out"): built for colocated TEs and PD pairs whose dies compute with their slots'
    experts only (a pair's prefill dies without TP, its decode dies colocated), and NPU-fork
    needs a TE serving from the start with the same shape to read from."""
    where = f"cluster TE {te.te} (group {te.group}, standby)"
    if te.kind not in ("colocated", "pd"):
        raise ConfigError(
            f"{where}: its kind is {te.kind}, but a standby TE's dies load their weights at "
            "scale-out, built for colocated TEs and PD pairs only; make the group colocated or "
            "a PD pair, or not standby"
        )
    te_cfg = te_config(cfg, te.overrides)
    if te_cfg.health.replicas != "none":
        raise ConfigError(
            f"{where} sets health.replicas={te_cfg.health.replicas}: the ring's replicas are not "
            "among the weights a standby die loads at scale-out; set health.replicas=none"
        )
    if te.kind == "pd" and (
        te_cfg.deployment.prefill_tp > 1 or te_cfg.deployment.kind != "colocated"
    ):
        raise ConfigError(
            f"{where}: a standby PD pair loads the weights of prefill dies without TP and of "
            f"colocated decode dies, but it has deployment.prefill_tp="
            f"{te_cfg.deployment.prefill_tp} and deployment.kind={te_cfg.deployment.kind}; set "
            "deployment.prefill_tp=1 and deployment.kind=colocated, or not standby"
        )
    if te_cfg.scaling.path == "fork" and fork_source(cfg, tes, te.te) is None:
        raise ConfigError(
            f"{where} loads by scaling.path=fork, but no TE serving from the start has its shape "
            "(its config but the scaling section) to fork from; add such a group, or set "
            "scaling.path to dram, cold or ems"
        )


def fork_source(cfg: Config, tes, te: int) -> int | None:
    """NPU-fork's source for TE `te`: the first TE serving from the start (not standby) whose
    config is TE `te`'s but for the scaling section (the same dies, expert slots and tensors),
    or None."""

    def shape(info: TeInfo) -> dict:
        return {k: v for k, v in te_config(cfg, info.overrides).to_dict().items() if k != "scaling"}

    wanted = shape(tes[te])
    return next((t.te for t in tes if not t.standby and shape(t) == wanted), None)


def check_cluster(cfg: Config, *, clock) -> None:
    """What a TE of a cluster needs of its config: colocated or afd TEs, or PD pairs with a
    decode TE-shell, on the virtual clock (the JE routes at virtual arrivals); nothing else that
    acts on the wall clock. `xds-mpi serve` (serve.enabled) routes on the wall clock instead,
    its clients' (docs/serve.md "A cluster"), to colocated and afd TEs."""
    num, dep, is_served = cfg.cluster.num_tes, cfg.deployment, cfg.serve.enabled
    hosts = 2 if cfg.pd.enabled else 1
    unsupported = {
        "deployment.num_prefill_dies without pd.enabled": not cfg.pd.enabled
        and dep.num_prefill_dies > 0,
        f"deployment.num_host_ranks other than {hosts} ({'a PD pair' if hosts == 2 else 'a TE'}"
        f"{': its JE and its decode TE-shell' if hosts == 2 else ''})": dep.num_host_ranks != hosts,
        "eplb.enabled": cfg.eplb.enabled,
        f"the wall clock (this TE's: {clock.why})": not clock.is_virtual and not is_served,
    }
    for what, is_set in unsupported.items():
        if is_set:
            raise ConfigError(
                f"cluster.num_tes({num}) > 1 does not support {what} yet: a cluster is built for "
                "colocated and afd TEs and PD pairs on the virtual clock (docs/cluster.md); set "
                "cluster.num_tes=1"
            )
    served_unsupported = {
        "a PD pair (pd.enabled: its JE paces its prefill TEs by the cluster's promise on the "
        "virtual clock)": cfg.pd.enabled,
        "autoscaler.enabled (it scales at the JE's virtual decisions)": cfg.autoscaler.enabled,
        "cluster.num_jes > 1 (the endpoint runs on one JE)": cfg.cluster.num_jes > 1,
    }
    for what, is_set in served_unsupported.items():
        if is_served and is_set:
            raise ConfigError(
                f"xds-mpi serve (serve.enabled) on a cluster (cluster.num_tes({num}) > 1) does "
                f"not support {what} yet: it serves colocated and afd TEs on the wall clock "
                "(docs/serve.md, A cluster); drop it, or serve one TE (cluster.num_tes=1)"
            )
