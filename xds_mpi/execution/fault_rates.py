"""`faults.rate` resolved for one deployment: the per-call chance each die's injector draws with,
and the risk the validator judges (xds_mpi/plan/failures/rates.py has the steps).

A rate per die-hour needs the projected iteration, which the plan's layer cannot price
(xds_mpi/projection sits above it): it is projected here, as `xds-mpi project` prices an
iteration, at the run's own batch, KV length and MTP depth. The dies' FaultPlan finds its
deployment through the plan's record of it (`rates.deployment_of`), made when its
DeploymentPlan was built.
"""

from __future__ import annotations

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config, FaultsConfig
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.failures.rates import FaultRisk, deployment_of, fault_risk
from xds_mpi.plan.topology import Topology


def projected_iteration_s(cfg: Config, topo: Topology) -> float:
    """One decode iteration of this deployment on the pod (xds_mpi/projection/project.py), at
    the run's mean batch per DP group, mean KV length and MTP depth."""
    # Lazy import, die-hour rates only: the projection's layers are a measured start-up cost of
    # every die (ranks/core/die_parts.py imports them for afd dies only).
    from xds_mpi.projection.cost import Hardware
    from xds_mpi.projection.project import project

    w, sched = cfg.workload, cfg.scheduler
    groups = len(topo.ranks_with_role("colocated")) or len(topo.ranks_with_role("attention"))
    batch = min(sched.max_batch_per_die, max(1.0, w.num_requests / max(1, groups)))
    kv_len = (w.prompt_len + w.max_prompt_len) / 2 + (w.output_len + w.max_output_len) / 4
    hw = Hardware.from_profile(load_profile(cfg.hardware.profile))
    return project(
        cfg, cost_shape(), hw, batch_per_die=batch, kv_len=kv_len, mtp_depth=sched.mtp_depth
    ).iteration_s


def resolve(cfg: Config, topo: Topology) -> FaultRisk:
    """faults.rate's per-call chances and risk on this deployment, in any rate_unit."""
    is_hourly = cfg.faults.rate_unit == "die_hour" and cfg.faults.rate > 0
    return fault_risk(cfg, topo, projected_iteration_s(cfg, topo) if is_hourly else None)


def chance_per_call(faults: FaultsConfig, die: int) -> float:
    """The chance each XCCL call of `die` fails: faults.rate itself per call, else converted
    from the deployment `faults` belongs to."""
    if faults.rate_unit == "call" or faults.rate == 0:
        return faults.rate
    found = deployment_of(faults)
    if found is None:
        raise ValueError(
            f"die {die}: faults.rate_unit({faults.rate_unit}) is converted with the "
            "deployment's calls per iteration; build its DeploymentPlan first"
        )
    return resolve(*found).chance_for(die)
