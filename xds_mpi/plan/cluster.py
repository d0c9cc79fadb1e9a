"""The topology of a cluster (`cluster.num_tes` > 1, docs/cluster.md): world rank 0 is the job
executor (JE), then the TEs one after another, each [its TE-shell, its dies] exactly as the rest
of the config describes one deployment. Each TE runs on a communicator of its own, its ranks
renumbered 0..S-1 (TE-shell 0) as if it were the world, so its windows, scheduler, KV,
agreement and failure handling are one TE's; the JE and the TE-shells share a second one (the
link: JE 0, TE-shell of TE k at k + 1).

Phase 1 builds colocated TEs on the virtual clock only; the rest is refused, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.schema import Config, ConfigError

JE_RANK = 0  # the JE's world rank, and its rank on the link


@dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    """num_tes TEs of te_size ranks each behind the JE; policy: cluster.policy."""

    num_tes: int
    te_size: int
    policy: str

    @property
    def world_size(self) -> int:
        return 1 + self.num_tes * self.te_size

    def first_rank(self, te: int) -> int:
        """The world rank of TE `te`'s TE-shell (its rank 0)."""
        return 1 + te * self.te_size

    def te_of(self, world_rank: int) -> tuple[int, int]:
        """(TE, rank inside it) of a world rank; (-1, 0) for the JE."""
        if world_rank == JE_RANK:
            return -1, 0
        return divmod(world_rank - 1, self.te_size)

    def describe(self) -> str:
        """validate's lines: the JE and each TE's world ranks."""
        lines = [
            f"cluster: {self.num_tes} TEs of {self.te_size} ranks behind one JE, "
            f"policy {self.policy}, world size {self.world_size}",
            f"  JE: world rank {JE_RANK}",
        ]
        for te in range(self.num_tes):
            first = self.first_rank(te)
            last = first + self.te_size - 1
            lines.append(
                f"  TE {te}: world ranks {first}..{last} (TE-shell {first}, dies "
                f"{first + 1}..{last}; ranks 0..{self.te_size - 1} inside the TE)"
            )
        return "\n".join(lines)


def te_world_size(cfg: Config, world_size: int | None) -> int | None:
    """The size one TE's plan is built for, given the job's `world_size` (None: what the
    config needs)."""
    num = cfg.cluster.num_tes
    if num == 1 or world_size is None:
        return world_size
    if world_size < 1 + num or (world_size - 1) % num:
        raise ConfigError(
            f"world size {world_size} is not 1 JE + cluster.num_tes({num}) x a TE's ranks"
        )
    return (world_size - 1) // num


def check_cluster(cfg: Config, *, is_virtual: bool) -> None:
    """What phase 1 of a cluster needs of the rest of the config: colocated TEs on the virtual
    clock (the JE routes at virtual arrivals), nothing that acts on the wall clock."""
    # Lazy import: the policies are looked up only for a cluster.
    from xds_mpi.cluster.policies import check_policy, policy_names

    num, dep = cfg.cluster.num_tes, cfg.deployment
    if cfg.cluster.policy not in policy_names():
        raise ConfigError(
            f"cluster.policy({cfg.cluster.policy}) is no routing policy; known: "
            f"{', '.join(policy_names())} (xds_mpi/cluster/policies/)"
        )
    check_policy(cfg)
    faults = cfg.faults
    unsupported = {
        "deployment.kind afd": dep.kind != "colocated",
        "pd.enabled": cfg.pd.enabled or dep.num_prefill_dies > 0,
        "deployment.num_host_ranks other than 1": dep.num_host_ranks != 1,
        "eplb.enabled": cfg.eplb.enabled,
        "faults.table, faults.rate, faults.events": bool(
            faults.table or faults.rate or faults.events
        ),
        "serve.enabled (xds-mpi serve)": cfg.serve.enabled,
        "run.clock=wall": not is_virtual,
    }
    for what, is_set in unsupported.items():
        if is_set:
            raise ConfigError(
                f"cluster.num_tes({num}) > 1 does not support {what} yet: a cluster is built for "
                "colocated TEs on the virtual clock (docs/cluster.md); set cluster.num_tes=1"
            )
