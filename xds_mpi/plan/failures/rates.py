"""`faults.rate` in users' units, and what it does to a run before it runs.

The injector (xds_mpi/execution/faults.py) draws one chance per XCCL call. Users think in faults
per iteration or per die-hour of the pod, and a per-call rate that sounds small cannot succeed at
scale: every decode die votes on every attempt of an iteration, so an attempt fails when any
call of any die fails.

  Step 1: count each decode die's calls per iteration (`count_calls`), as its call plan makes
          them: a colocated die one dispatch and one combine per MoE call (the main MoE layers,
          then one per MTP depth: xds_mpi/execution/executor.py `moe_layers`); an attention die
          one A2E and one E2A per MoE call and microbatch of its domain, an expert die those of
          every domain (xds_mpi/afd/plan.py `AfdPlan.iteration` with every domain busy). Only
          the operations in faults.ops count.
  Step 2: convert to a per-call chance for each die (`per_call_chance`): with lambda the
          expected faults per die per iteration (rate_unit "iteration": the rate; "die_hour":
          rate x iteration_s / 3600, iteration_s the projected iteration, `xds-mpi project`) and
          c the die's calls, p = 1 - exp(-lambda / c), so that the die sees lambda faults an
          iteration on average (a Poisson count over its c calls).
  Step 3: the risk (`fault_risk`): an attempt fails with q = 1 - prod_d (1 - p_d) ** c_d; an
          iteration runs out of faults.max_retries with q ** (max_retries + 1), the run with
          1 - (1 - that) ** num_iterations.
  Step 4: refuse a run more likely than not to run out, warn above WARN_ABOVE (`judge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xds_mpi.config.schema import Config, ConfigError, FaultsConfig
from xds_mpi.plan.topology import Topology

REFUSE_ABOVE = 0.5  # a run more likely than not to exhaust faults.max_retries is refused
WARN_ABOVE = 0.01  # ... and one with a chance above 1 % is warned about
SERVED_ITERATIONS = 100_000  # a served run's horizon (no workload ends it): ~2 h at 70 ms
HOUR_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class FaultRisk:
    """What faults.rate means for one deployment.

    rate, unit: the user's faults.rate and faults.rate_unit;
    calls_per_die: decode die rank -> XCCL calls (of faults.ops) one iteration makes there;
    iteration_s: the projected iteration on the pod (die_hour only, else None);
    per_call: decode die rank -> the chance each of its calls fails (what the injector draws);
    attempt_failure: the share of an iteration's attempts in which some die's call fails;
    exhaust_per_iteration: the chance one iteration fails faults.max_retries + 1 attempts;
    num_iterations: the run's iterations (an upper estimate from the workload; a served run:
    SERVED_ITERATIONS); exhaust_run: the chance any of them runs out."""

    rate: float
    unit: str
    max_retries: int
    calls_per_die: dict[int, int]
    iteration_s: float | None
    per_call: dict[int, float]
    attempt_failure: float
    exhaust_per_iteration: float
    num_iterations: int
    exhaust_run: float

    def chance_for(self, die: int) -> float:
        """The per-call chance on `die`; a die with no iteration calls (a prefill die's KV
        transfers) draws with the decode dies' mean."""
        if die in self.per_call:
            return self.per_call[die]
        return sum(self.per_call.values()) / len(self.per_call) if self.per_call else 0.0

    def describe(self) -> str:
        """The numbers, one line: what validate shows and the refusal carries."""
        hour = f", projected iteration {self.iteration_s * 1e3:.1f} ms" if self.iteration_s else ""
        calls = sorted(set(self.calls_per_die.values()))
        chances = sorted(set(self.per_call.values()))
        return (
            f"faults.rate({self.rate:g} per {self.unit.replace('_', '-')}{hour}): "
            f"{'/'.join(map(str, calls))} calls per die per iteration over "
            f"{len(self.calls_per_die)} decode dies, {_span(chances)} per call; "
            f"{self.attempt_failure:.1%} of attempts fail, an iteration exhausts "
            f"faults.max_retries({self.max_retries}) with chance {self.exhaust_per_iteration:.2e}, "
            f"the run ({self.num_iterations} iterations) with {self.exhaust_run:.1%}"
        )


def _span(values: list[float]) -> str:
    if not values:
        return "0"
    return f"{values[0]:.3g}" if len(values) == 1 else f"{values[0]:.3g}..{values[-1]:.3g}"


def count_calls(cfg: Config, topo: Topology) -> dict[int, int]:
    """Step 1: decode die rank -> the XCCL calls one iteration makes there that faults.rate can
    fail (faults.ops)."""
    model, ops = cfg.model, set(cfg.faults.ops)
    num_moe = model.num_layers - model.num_dense_layers + cfg.scheduler.mtp_depth
    per_colocated = num_moe * (("dispatch" in ops) + ("combine" in ops))
    per_afd = num_moe * cfg.deployment.num_microbatches * (("a2e" in ops) + ("e2a" in ops))
    calls = {}
    for info in topo.ranks:
        if info.role == "colocated":
            calls[info.rank] = per_colocated
        elif info.role == "attention":
            calls[info.rank] = per_afd
        elif info.role == "expert":
            calls[info.rank] = per_afd * topo.num_dp_domains
    return calls


def per_call_chance(rate: float, unit: str, calls: int, iteration_s: float | None) -> float:
    """Step 2: the chance each of a die's `calls` calls per iteration fails."""
    if unit == "call" or rate == 0:
        return rate
    if calls == 0:
        return 0.0
    per_iteration = rate if unit == "iteration" else rate * iteration_s / HOUR_S
    return -math.expm1(-per_iteration / calls)


def estimate_iterations(cfg: Config, topo: Topology) -> int:
    """The run's iterations with work, from above: waves of requests (as many at once as the
    decode dies' batches hold), each its longest prefill in chunks and its longest output one
    token an iteration (MTP's accepted drafts only shorten it). A served run: SERVED_ITERATIONS."""
    if cfg.serve.enabled:
        return SERVED_ITERATIONS
    w, sched = cfg.workload, cfg.scheduler
    groups = len(topo.ranks_with_role("colocated")) or len(topo.ranks_with_role("attention"))
    waves = math.ceil(w.num_requests / max(1, sched.max_batch_per_die * groups))
    prefill = 0 if cfg.pd.enabled else math.ceil(w.max_prompt_len / sched.prefill_chunk_tokens)
    return waves * (prefill + max(w.output_len, w.max_output_len))


def fault_risk(cfg: Config, topo: Topology, iteration_s: float | None = None) -> FaultRisk:
    """Step 3: faults.rate's risk on this deployment. iteration_s: the projected iteration,
    needed for rate_unit die_hour only (xds_mpi/execution/fault_rates.py projects it)."""
    faults = cfg.faults
    if faults.rate_unit == "die_hour" and iteration_s is None:
        raise ValueError("faults.rate_unit die_hour needs the projected iteration time")
    calls = count_calls(cfg, topo)
    per_call = {
        die: per_call_chance(faults.rate, faults.rate_unit, n, iteration_s)
        for die, n in calls.items()
    }
    log_ok = sum(n * math.log1p(-per_call[die]) for die, n in calls.items())
    attempt_failure = -math.expm1(log_ok)
    exhaust = attempt_failure ** (faults.max_retries + 1)
    num_iterations = estimate_iterations(cfg, topo)
    exhaust_run = -math.expm1(num_iterations * math.log1p(-exhaust)) if exhaust < 1 else 1.0
    return FaultRisk(
        rate=faults.rate,
        unit=faults.rate_unit,
        max_retries=faults.max_retries,
        calls_per_die=calls,
        iteration_s=iteration_s if faults.rate_unit == "die_hour" else None,
        per_call=per_call,
        attempt_failure=attempt_failure,
        exhaust_per_iteration=exhaust,
        num_iterations=num_iterations,
        exhaust_run=exhaust_run,
    )


def judge(risk: FaultRisk) -> str:
    """Step 4: refuse (ConfigError naming faults.rate, with the numbers) a run more likely than
    not to exhaust faults.max_retries; the warning's text above WARN_ABOVE, else ""."""
    if risk.exhaust_run > REFUSE_ABOVE:
        raise ConfigError(
            f"{risk.describe()}: the run is more likely than not to end in RetriesExhausted; "
            "lower faults.rate or raise faults.max_retries (docs/failures.md, Fault rates)"
        )
    if risk.exhaust_run > WARN_ABOVE:
        return f"{risk.describe()}: above {WARN_ABOVE:.0%}"
    return ""


# The deployment each checked faults section belongs to, by identity: the dies' injector
# (xds_mpi/execution/fault_rates.py) converts a rate per iteration or die-hour with it, and is
# given only the faults section. Every rank builds its DeploymentPlan, which checks the faults,
# before it builds a die; a process keeps the few it checked last.
_MAX_REMEMBERED = 8
_deployments: dict[int, tuple[FaultsConfig, Config, Topology]] = {}


def remember_deployment(cfg: Config, topo: Topology) -> None:
    _deployments.pop(id(cfg.faults), None)
    _deployments[id(cfg.faults)] = (cfg.faults, cfg, topo)
    while len(_deployments) > _MAX_REMEMBERED:
        del _deployments[next(iter(_deployments))]


def deployment_of(faults: FaultsConfig) -> tuple[Config, Topology] | None:
    found = _deployments.get(id(faults))
    if found is None or found[0] is not faults:
        return None
    return found[1], found[2]


def check_fault_rate(cfg: Config, topo: Topology) -> None:
    """What DeploymentPlan.build checks (every rank): the deployment remembered for the
    injector, and a rate per call or per iteration judged (a die-hour rate needs the projection,
    which the launcher's validate and run judge: launch/cli/main.py)."""
    remember_deployment(cfg, topo)
    if cfg.faults.rate > 0 and cfg.faults.rate_unit != "die_hour":
        judge(fault_risk(cfg, topo))
