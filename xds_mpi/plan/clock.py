"""Which clock drives serving (`run.clock`, docs/virtual_time.md): the dies' 910C virtual clock,
or this machine's wall clock.

Virtual time is built for the colocated and afd deployments' `xds-mpi run`: the TE-shell grants
the dies a horizon and decides each arrival at its virtual time (ranks/shell/virtual_time.py,
ranks/core/virtual_time.py; afd's attention and expert dies agree on the common start as the
colocated dies do, ranks/afd/common.py); and for PD (colocated or afd decode dies) with a decode
TE-shell: the JE paces the prefill TEs, the decode TE-shell the decode dies
(ranks/shell/pd_pacers.py), fault-free, with transient XCCL faults on the decode dies (their
rollbacks are priced on the dies' clocks, ranks/recovery/recompute.py) or with colocated decode
dies or afd attention dies lost for good (their failover priced as the colocated TE-shell's);
PD's other faults act on the wall clock. The rest still takes requests when they arrive on the
wall clock, and `xds-mpi serve` stays paced by the wall clock for good: its HTTP clients live in
it. `auto` picks virtual where it is built; an explicit `virtual` anywhere else is refused, naming
the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.schema import Config, ConfigError

# The KV transfers' operations (a PD run's p2p sends and receives, retried by their senders).
KV_OPS = ("p2p_send", "p2p_recv")


@dataclass(frozen=True, kw_only=True)
class ServingClock:
    """kind: "virtual" or "wall"; why: the reason, for the run log."""

    kind: str
    why: str

    @property
    def is_virtual(self) -> bool:
        return self.kind == "virtual"


def serving_clock(cfg: Config) -> ServingClock:
    """The clock `run.clock` asks for on this deployment; refused where virtual is not built."""
    wanted = cfg.run.clock
    missing = _why_wall(cfg)
    if wanted == "virtual" and missing:
        raise ConfigError(
            f"run.clock(virtual) is not built for {missing} yet; set run.clock=wall or auto"
        )
    if wanted == "wall":
        return ServingClock(kind="wall", why="run.clock=wall")
    if missing:
        return ServingClock(
            kind="wall", why=f"run.clock={wanted}: virtual time is not built for {missing} yet"
        )
    return ServingClock(
        kind="virtual",
        why=f"run.clock={wanted}: arrivals, admission and the DP balancer at the dies' 910C "
        "virtual times, idle time skipped",
    )


def _why_wall(cfg: Config) -> str:
    """What in `cfg` virtual time does not cover yet ("" when it covers all)."""
    if cfg.serve.enabled:
        return "xds-mpi serve (its HTTP clients live on the wall clock: serve.enabled)"
    if cfg.pd.enabled or cfg.deployment.num_prefill_dies:
        return _why_wall_pd(cfg)
    return ""


def _why_wall_pd(cfg: Config) -> str:
    """What of a PD deployment virtual time does not cover yet ("" when it covers all): the JE
    paces the prefill TEs and the decode TE-shell the decode dies (ranks/shell/pd_pacers.py)."""
    if cfg.deployment.num_host_ranks != 2:
        return "PD without a decode TE-shell rank (deployment.num_host_ranks 1)"
    faults = cfg.faults
    if faults.events and not _decode_loss_for_good(cfg):
        return (
            "PD with faults.events other than colocated decode dies or afd attention dies lost "
            "for good (prefill losses, a stuck decode die that may come back, link and "
            "saturated KV paths, a cluster's PD pair: detected, re-routed and prefilled again "
            "on the wall clock)"
        )
    if any(row.op in KV_OPS for row in faults.table) or (
        faults.rate and set(faults.ops) & set(KV_OPS)
    ):
        return (
            "PD with faults on the KV transfers (a faults.table row, or faults.rate with "
            "faults.ops, on p2p_send or p2p_recv: their senders retry on the wall clock)"
        )
    return ""


def _decode_loss_for_good(cfg: Config) -> bool:
    """Every faults.events row loses a decode DP group's die for good (dead, or stuck with
    duration_s 0: a colocated decode die, or an afd decode side's attention die), outside a
    cluster: the decode TE-shell's pacer drops and prices it, and bounds what the JE promises
    meanwhile (ranks/shell/pd_pacers.py)."""
    # Lazy import: the topology's module imports the plan package this module belongs to.
    from xds_mpi.plan.topology import Topology

    if cfg.cluster.num_tes > 1:
        return False
    ranks = Topology.from_config(cfg).ranks
    return all(
        row.kind in ("dead", "stuck")
        and row.duration_s == 0
        and 0 <= row.die < len(ranks)
        and ranks[row.die].role in ("colocated", "attention")
        for row in cfg.faults.events
    )
