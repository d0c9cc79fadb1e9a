"""DeploymentPlan: everything derived from a config, in one place, refused when it cannot run.

`DeploymentPlan.build(cfg, world_size)` is what `xds-mpi validate`, `run` and `submit` and every
rank (launch/job/rank.py) call: the topology (rank map, expert placement), the XCCL layouts and each
die's window size, the row dtype of dispatch/combine and A2E/E2A. It refuses, with the reason and
the numbers, a checkpoint saved for another model shape, a world size or pod that does not fit,
MTP or fault settings that cannot work, a window over the per-die cap, and a workload in which no
request could be served.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xccl.layout import P2PLayout
from xccl.moe_layout import AfdLayout, EpLayout
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.model.checkpoint import check_checkpoint
from xds_mpi.plan.clock import ServingClock, serving_clock
from xds_mpi.plan.cluster import ClusterPlan, plan_cluster, te_config
from xds_mpi.plan.ems import EmsPlan, build_ems, check_ems, ems_window_bytes
from xds_mpi.plan.eplb import check_eplb
from xds_mpi.plan.fabric import afd_layout, ep_layout, p2p_layout, window_bytes
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.pd import PdPlan, build_pd, check_pd_fault, pd_window_bytes
from xds_mpi.plan.topology import Topology
from xds_mpi.workload.requests import rejection
from xds_mpi.workload.stream import load_workload


@dataclass(frozen=True, kw_only=True)
class DeploymentPlan:
    """cfg: the user's config, untouched; topo: ranks -> roles and expert slots;
    p2p: ring layout of every rank's window (first in each window); ep: dispatch/combine area of
    a colocated deployment, else None; afd: A2E/E2A area of an afd one, else None;
    row_dtype: dtype of the rows XCCL moves without INT8 (the layouts size rows with its itemsize);
    window_bytes: [world_size] bytes of each rank's window (host ranks: 0);
    pd: disaggregated prefill-decode (xds_mpi/plan/pd.py), None unless pd.enabled;
    ems: the EMS context cache's pool (xds_mpi/plan/ems.py), None unless ems.enabled;
    clock: which clock drives serving (run.clock, xds_mpi/plan/clock.py);
    cluster: cluster.num_tes > 1 (xds_mpi/plan/cluster.py): the JE and the TEs' world ranks,
    every other field then one TE's (each TE runs on a communicator of its own), else None."""

    cfg: Config
    topo: Topology
    p2p: P2PLayout
    ep: EpLayout | None
    afd: AfdLayout | None
    row_dtype: np.dtype
    window_bytes: tuple[int, ...]
    pd: PdPlan | None = None
    ems: EmsPlan | None = None
    clock: ServingClock = ServingClock(kind="wall", why="run.clock=wall")
    cluster: ClusterPlan | None = None

    @property
    def world_size(self) -> int:
        """The job's ranks: one TE's, or a cluster's JE and every TE's."""
        return self.topo.world_size if self.cluster is None else self.cluster.world_size

    @classmethod
    def build(
        cls,
        cfg: Config,
        world_size: int | None = None,
        *,
        launcher_checks: bool = True,
        te: int | None = None,
    ) -> DeploymentPlan:
        """Derive the plan; world_size: the communicator's size (None: what the config needs).
        launcher_checks: open the checkpoint to check its tensors' shapes, and make or read the
        workload to refuse one of which no request can be served. The launcher does (before
        launch: every rank would die loading the checkpoint, the job would serve nothing); the
        ranks do not (each would open the file and walk its tensors again, a die's own load
        checks the shapes it reads, and only the TE-shell reads the workload: every rank
        generating it cost numpy.random's import and a pass over the requests).
        te: in a cluster, the plan of TE `te` with its config (its group's overrides); None: the
        JE's, with the config as given and TE 0's topology (validate's rank map)."""
        if launcher_checks:
            check_checkpoint(cfg.model)
        cluster = plan_cluster(cfg)  # None: one TE (xds_mpi/plan/cluster.py)
        if cluster is not None:  # the plan of one TE, its ranks 0..S-1
            if world_size is not None and world_size != cluster.world_size:
                raise ConfigError(
                    f"world size {world_size} is not the cluster's {cluster.world_size} "
                    f"(1 JE + the TEs' ranks)"
                )
            if te is None:  # the launcher's and validate's: every kind of TE checked whole
                _check_tes(cfg, cluster)
            info = cluster.tes[0 if te is None or te < 0 else te]
            te_cfg = te_config(cfg, info.overrides)
            world_size = info.size
            if te is not None and te >= 0:
                cfg = te_cfg
        else:
            te_cfg = cfg
        topo = Topology.from_config(te_cfg, world_size)  # size, pod, placement
        check_ems(te_cfg, topo)  # the EMS pool's refusals name pool ranks before the fault checks
        check_serving(te_cfg, topo)
        clock = serving_clock(te_cfg)
        # The one source of the row dtype: a wire format (the model computes in its own dtype;
        # the reference rounds rows at the same points, xds_mpi/model/moe.py Wire).
        row_dtype = np.dtype(te_cfg.xccl.row_dtype)
        try:
            p2p = p2p_layout(te_cfg, topo)
            ep = ep_layout(te_cfg, topo, p2p, row_dtype.itemsize)
            afd = afd_layout(te_cfg, topo, p2p, row_dtype.itemsize)
            pd = build_pd(te_cfg, topo, p2p, row_dtype.itemsize)
            ems = build_ems(te_cfg, topo)
        except ConfigError:
            raise
        except ValueError as exc:  # a layout's own refusal, e.g. slot_bytes not a multiple of 8
            raise ConfigError(f"xccl: {exc}") from None
        windows = window_bytes(te_cfg, p2p, ep, afd)  # refused over xccl.max_window_bytes
        windows = pd_window_bytes(te_cfg, pd, windows)
        if ems is not None and any(windows[r] for r in ems.pool):
            raise ConfigError(f"ems: pool ranks {list(ems.pool)} must hold no p2p ring")
        windows = ems_window_bytes(ems, windows)
        if launcher_checks:
            check_workload(cfg, topo)
        return cls(
            cfg=cfg,
            topo=topo,
            p2p=p2p,
            ep=ep,
            afd=afd,
            row_dtype=row_dtype,
            window_bytes=windows,
            pd=pd,
            ems=ems,
            clock=clock,
            cluster=cluster,
        )


def _check_tes(cfg: Config, cluster: ClusterPlan) -> None:
    """Each group's first TE planned as its ranks will plan it (beyond TE 0's: the plan
    returned), its refusals naming the TE and its group."""
    seen = {cluster.tes[0].overrides}
    for info in cluster.tes[1:]:
        if info.overrides in seen:
            continue
        seen.add(info.overrides)
        try:
            DeploymentPlan.build(cfg, cluster.world_size, launcher_checks=False, te=info.te)
        except ConfigError as exc:
            raise ConfigError(f"cluster TE {info.te} (group {info.group}): {exc}") from None


def check_serving(cfg: Config, topo: Topology) -> None:
    """What MTP and the fault table need of the rest of the config."""
    depth = cfg.scheduler.mtp_depth
    if depth and not cfg.model.num_mtp_modules:
        raise ConfigError(
            f"scheduler.mtp_depth({depth}) needs a model with MTP modules "
            "(model.num_mtp_modules is 0)"
        )
    if depth and cfg.xccl.max_tokens_per_die < 2 * depth:
        raise ConfigError(
            f"xccl.max_tokens_per_die({cfg.xccl.max_tokens_per_die}) cannot hold "
            f"one verify step at scheduler.mtp_depth({depth}): needs >= {2 * depth} "
            f"(1 + {depth} drafts + {depth - 1} rows for the deeper MTP passes)"
        )
    check_two_streams(cfg)
    _check_fault_table(cfg, topo)
    check_failures(cfg, topo)  # faults.events (xds_mpi/plan/failures/checks.py)
    check_eplb(cfg, len({info.rank for info in topo.ranks if _hosts_routed(info)}))


def check_two_streams(cfg: Config) -> None:
    """The colocated two-stream decode (deployment.num_microbatches 2,
    xds_mpi/execution/two_streams.py) runs without what rebuilds or swaps its two EP lanes
    mid-run: no fault rows (token recomputation restores one attempt of one lane's sequence), no
    vertical scaling (a failover rebuilds one buffer), no EPLB (its swap phases assume one lane),
    no PD (the decode dies' KV intake is not scheduled between the streams)."""
    dep = cfg.deployment
    if dep.kind != "colocated" or dep.num_microbatches == 1:
        return
    unsupported = {
        "faults.table": bool(cfg.faults.table),
        "faults.rate": cfg.faults.rate > 0,
        "faults.events": bool(cfg.faults.events),
        "health.replicas": cfg.health.replicas != "none",
        "eplb.enabled": cfg.eplb.enabled,
        "pd.enabled": cfg.pd.enabled or dep.num_prefill_dies > 0,
    }
    for key, is_set in unsupported.items():
        if is_set:
            raise ConfigError(
                f"deployment.num_microbatches({dep.num_microbatches}) on a colocated deployment "
                f"(the two-stream decode) does not support {key} yet; set "
                "deployment.num_microbatches=1 or turn it off (docs/two_streams.md)"
            )


def _hosts_routed(info) -> bool:
    return any(slot.kind == "routed" for slot in info.expert_slots)


def _check_fault_table(cfg: Config, topo: Topology) -> None:
    """Every row names a die, a MoE layer (MTP blocks included) and an operation the run makes."""
    depth, model = cfg.scheduler.mtp_depth, cfg.model
    num_cache_layers = model.num_layers + depth
    first, last = topo.num_host_ranks, topo.num_host_ranks + topo.num_dies - 1
    for i, spec in enumerate(cfg.faults.table):
        if check_pd_fault(cfg, topo, i, spec):
            continue  # a KV-transfer fault of a PD run (xds_mpi/plan/pd.py)
        if spec.op.startswith("p2p"):
            raise ConfigError(
                f"faults.table[{i}].op({spec.op}): a {cfg.deployment.kind} decode "
                "run makes no p2p transfers, so this fault could never fire (p2p "
                "faults are exercised by tests/mpi/body_faults_p2p.py)"
            )
        if not first <= spec.die <= last:
            raise ConfigError(
                f"faults.table[{i}].die({spec.die}) is not a die: dies are ranks {first}..{last}"
            )
        if not model.num_dense_layers <= spec.layer < num_cache_layers:
            raise ConfigError(
                f"faults.table[{i}].layer({spec.layer}) is not a MoE layer: "
                f"layers {model.num_dense_layers}..{num_cache_layers - 1} are "
                f"(model.num_dense_layers({model.num_dense_layers}), "
                f"num_layers({model.num_layers}) + scheduler.mtp_depth({depth}))"
            )


def check_workload(cfg: Config, topo: Topology) -> None:
    """Refuse a serving run in which no request could be served (the workload is generated or
    read once: cheap next to the run it saves)."""
    if not topo.ranks_with_role("colocated") + topo.ranks_with_role("attention"):
        return
    requests = load_workload(cfg)
    reasons = [rejection(req, cfg) for req in requests]
    if requests and all(reasons):
        raise ConfigError(
            f"none of the {len(requests)} requests can be served; the first: {reasons[0]}"
        )
