"""Losing a decode die (a stuck or dead row on a colocated, attention or expert die), checked before
launch (xds_mpi/plan/failures/checks.py): what the TE-shell's vertical scaling
(ranks/recovery/detector.py, ranks/recovery/scale_down.py) cannot go on with is refused here, naming
why, so that no accepted config stops at run time for it. Transient XCCL faults (faults.table,
faults.rate) beside the loss go on injecting and recomputing on the survivors' communicator."""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.failures import FailureSpec
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.plan.topology import Topology

# Seconds the TE-shell's release takes at most after detection (ranks/recovery/detector.py): two
# graces.
RELEASE_GRACES = 2


def release_bound_s(health) -> float:
    """Seconds from a die's silence to the end of the TE-shell's release at most
    (ranks/recovery/detector.py): timeout_s + one ping interval + RELEASE_GRACES graces."""
    return health.timeout_s + health.dp_interval_s + RELEASE_GRACES * health.release_grace_s


# Seconds the survivors take to rebuild after the release (ranks/recovery/scale_down.py: a
# communicator without the lost dies, the XCCL windows on it, the expert placement without their
# slots) on the pod. Neither xDeepServe nor this repo measures it; an assumption, stated in
# docs/virtual_time.md. Replica weights a survivor loads (EPLB's take_over) are priced apart, as
# weight pulls off the critical path.
REBUILD_S = 0.5


@dataclass(frozen=True, kw_only=True)
class FailoverCost:
    """A decode die's loss (stuck or dead row) priced on the virtual clock (run.clock virtual),
    seconds from the survivors' last iteration boundary before it (docs/virtual_time.md):
    detection, a die silent for health.timeout_s found by the next ping (one
    health.dp_interval_s at worst); release, the fence and the detector's RELEASE_GRACES graces
    watching for answers (ranks/recovery/detector.py); rebuild, REBUILD_S."""

    detection_s: float
    release_s: float
    rebuild_s: float

    @classmethod
    def of(cls, health) -> FailoverCost:
        return cls(
            detection_s=health.timeout_s + health.dp_interval_s,
            release_s=RELEASE_GRACES * health.release_grace_s,
            rebuild_s=REBUILD_S,
        )

    @property
    def total_s(self) -> float:
        return self.detection_s + self.release_s + self.rebuild_s


def check_decode_loss(cfg: Config, topo: Topology) -> None:
    rows = [
        i
        for i, e in enumerate(cfg.faults.events)
        if e.kind in ("stuck", "dead") and topo.ranks[e.die].role != "prefill"
    ]
    # With faults.table / faults.rate beside the loss, the survivors' vote moves to their
    # communicator (ranks/recovery/recompute.py Recomputer.regroup) and the fault plan goes on
    # there; only a table row the loss keeps from firing is refused.
    _check_rows_after_loss(cfg, rows)
    _check_mtp_loss(cfg, rows)
    if cfg.deployment.kind == "afd" and not cfg.pd.enabled:
        _check_afd_loss(topo, cfg.faults.events)


def _check_rows_after_loss(cfg: Config, rows: list[int]) -> None:
    """A faults.table row on a die that is lost before the row's iteration would never fire (a
    dead row at iteration N: the die runs iterations 0..N-1; stuck for good: it blocks in
    iteration N-1); refused rather than silently dropped from the run's fault count."""
    events = cfg.faults.events
    for i in rows:
        e = events[i]
        if e.at_s is not None or (e.kind == "stuck" and e.duration_s > 0):
            continue  # a virtual time, or a die that may come back
        for j, row in enumerate(cfg.faults.table):
            if row.die == e.die and row.iteration >= e.iteration:
                raise ConfigError(
                    f"faults.table[{j}]: die {row.die} at iteration {row.iteration}, but "
                    f"faults.events[{i}] ({e.kind}, iteration {e.iteration}) loses that die "
                    f"first: it runs iterations 0..{e.iteration - 1} only, so the row would "
                    f"never fire; give it an iteration below {e.iteration} or another die"
                )


def _check_mtp_loss(cfg: Config, rows: list[int]) -> None:
    """A lost decode die's requests are prefilled again elsewhere with the tokens they emitted
    (ranks/recovery/scale_down.py resumed): their tokens equal the reference's, but their MTP
    drafts restart from that prefill, so the drafts and acceptance `--check` compares step by
    step do not (measured: colocated and afd, 1-2 mismatches of 8 requests). A stuck row shorter
    than health.timeout_s loses no die and stays accepted."""
    depth, timeout_s = cfg.scheduler.mtp_depth, cfg.health.timeout_s
    events = cfg.faults.events
    losing = [
        i for i in rows if events[i].kind == "dead" or not 0 < events[i].duration_s < timeout_s
    ]
    if depth and losing:
        raise ConfigError(
            f"faults.events{losing}: a decode die that may be lost (dead, or stuck for good or "
            f"for >= health.timeout_s({timeout_s:g}) s) with scheduler.mtp_depth({depth}) is "
            "refused: its requests are prefilled again elsewhere and their MTP drafts restart "
            "from that prefill, so they no longer match the reference's step by step; set "
            "scheduler.mtp_depth 0 or a shorter stuck row"
        )


def _check_afd_loss(topo: Topology, events: list[FailureSpec]) -> None:
    """An afd run recovers from one lost attention die whose DP domain keeps another
    (ranks/recovery/scale_down.py); a second loss would rebuild a rebuilt layout (not
    emulated)."""
    rows = [i for i, e in enumerate(events) if e.kind in ("stuck", "dead")]
    if len(rows) > 1:
        raise ConfigError(
            f"faults.events{rows}: {len(rows)} stuck/dead rows in one afd run; one is emulated "
            "(after it the dies run on a rebuilt layout, and the rebuild starts only from the "
            "launch's)"
        )
    for i in rows:
        info = topo.ranks[events[i].die]
        domain = topo.domain_ranks(info.dp_domain) if info.role == "attention" else ()
        if len(domain) == 1:
            raise ConfigError(
                f"faults.events[{i}]: attention die {info.rank} is the only die of DP domain "
                f"{info.dp_domain} (deployment.dp_groups_per_domain 1); losing a whole domain "
                "would need its requests moved to other domains and the A2E/E2A layout rebuilt "
                "without it, which afd's failover does not do"
            )
