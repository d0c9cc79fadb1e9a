"""One scale-out event as DeepServe's five steps (§6, Table 2), priced on the 910C clock: when
the new TEs can serve, and what each step spent. Pure functions of the config.

    timeline = scale_out(cfg, num_dies=32, num_new_tes=8)
    timeline.total_s   # seconds from the scaling decision to the new TEs taking requests
    timeline.steps     # (("Scaler-Pre", s), ("TE-Pre-Load", s), ...)

NPU-fork needs a serving TE of the same shape as the source; the caller (the JE) knows whether
one exists (DeepServe §6.2: not when scaling from 0 TEs) and picks another path where not.
docs/scaling.md has the model, every figure's source and the validation.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.scaling.load import LoadPrice, te_load, ub_figures
from xds_mpi.scaling.weights import cost_shape_bytes

STEP_NAMES = ("Scaler-Pre", "TE-Pre-Load", "TE-Load", "TE-Post-Load", "Scaler-Post")


@dataclass(frozen=True, kw_only=True)
class ScaleStep:
    """One of the five steps: name (Table 2's), seconds, what it does, and what removed or
    shortened it ('' nothing)."""

    name: str
    seconds: float
    what: str
    saved_by: str = ""


@dataclass(frozen=True, kw_only=True)
class ScaleTimeline:
    """A scale event of `num_new_tes` TEs of `num_dies` dies each, all at once: its five
    `phases` in order, TE-Load's detail in `load`."""

    num_dies: int
    num_new_tes: int
    phases: tuple[ScaleStep, ...]
    load: LoadPrice

    @property
    def steps(self) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of each step, in order."""
        return tuple((p.name, p.seconds) for p in self.phases)

    @property
    def total_s(self) -> float:
        return sum(p.seconds for p in self.phases)


def scale_out(
    cfg: Config,
    *,
    num_dies: int,
    num_new_tes: int,
    model_bytes: float | None = None,
    fanout: int | None = None,
) -> ScaleTimeline:
    """The five steps for `num_new_tes` TEs of `num_dies` dies each (cfg: the new TE's config,
    cfg.scaling its path and costs). model_bytes: the model's size (None: DeepSeek-V3 at the
    profile's weight precision, xds_mpi/scaling/weights.py); fanout: the fork's broadcast
    fan-out (None: cfg.scaling.fork_fanout)."""
    if num_dies < 1 or num_new_tes < 1 or (fanout is not None and fanout < 1):
        raise ConfigError(
            f"scale_out needs num_dies >= 1, num_new_tes >= 1 and fanout >= 1; got num_dies "
            f"{num_dies}, num_new_tes {num_new_tes}, fanout {fanout}"
        )
    sc = cfg.scaling
    model = cost_shape_bytes(ub_figures(cfg.hardware.profile).weight_bytes)
    if model_bytes is not None:
        model = model.scaled_to(model_bytes)
    load = te_load(
        cfg,
        num_dies=num_dies,
        num_new_tes=num_new_tes,
        model=model,
        fanout=sc.fork_fanout if fanout is None else fanout,
    )
    phases = (
        scaler_pre(cfg),  # Step 1 (Table 2): pods to hold the TE
        te_pre_load(cfg),  # Step 2: the engine started, no model
        ScaleStep(name="TE-Load", seconds=load.seconds, what=LOAD_WHAT[sc.path]),  # Step 3
        te_post_load(cfg),  # Step 4: ready to serve
        scaler_post(cfg),  # Step 5: the JEs learn of the new TEs
    )
    return ScaleTimeline(num_dies=num_dies, num_new_tes=num_new_tes, phases=phases, load=load)


LOAD_WHAT = {
    "fork": "weights from a serving TE's dies over the UB (NPU-fork)",
    "dram": "weights from the host's DRAM page cache over PCIe (DRAM-hit)",
    "cold": "weights fetched from OBS, then over PCIe (DRAM-miss)",
    "ems": "weights from the EMS pool over the UB (model caching)",
}


def scaler_pre(cfg: Config) -> ScaleStep:
    """Creating the pods that hold the TE; nothing with a pre-warmed pod (§6.1)."""
    sc = cfg.scaling
    return ScaleStep(
        name="Scaler-Pre",
        seconds=0.0 if sc.prewarmed_pods else sc.pod_create_s,
        what="pods created to hold the TE",
        saved_by="pre-warmed pods" if sc.prewarmed_pods else "",
    )


def te_pre_load(cfg: Config) -> ScaleStep:
    """Python start-up, NPU init and the communication domains; nothing with a pre-warmed TE,
    35 % less with late imports and parallel initialization (§6.1)."""
    sc = cfg.scaling
    seconds = sc.python_startup_s + sc.npu_init_s + sc.comm_init_s
    saved_by = "parallel init" if sc.parallel_init else ""
    if sc.parallel_init:
        seconds *= 1 - sc.parallel_init_saving
    if sc.prewarmed_tes:
        seconds, saved_by = 0.0, "pre-warmed TEs"
    return ScaleStep(
        name="TE-Pre-Load",
        seconds=seconds,
        what="engine started without its model (Python, NPU, communicators)",
        saved_by=saved_by,
    )


def te_post_load(cfg: Config) -> ScaleStep:
    """The engine's warm-up and block allocation, or with offline profiling (the KV size from
    a profile, blocks allocated asynchronously) one dummy request (§6, Table 2 row 4)."""
    sc = cfg.scaling
    if sc.offline_profiling:
        seconds, saved_by = sc.dummy_request_s, "offline profiling"
    else:
        seconds, saved_by = sc.warmup_s + sc.block_alloc_s, ""
    return ScaleStep(
        name="TE-Post-Load",
        seconds=seconds,
        what="warm-up and KV block allocation",
        saved_by=saved_by,
    )


def scaler_post(cfg: Config) -> ScaleStep:
    """The new TE list reaching the JEs: pushed, or found at the JE's next poll (half a poll
    period on average) (Table 2 row 5)."""
    sc = cfg.scaling
    pushed = sc.proactive_push
    return ScaleStep(
        name="Scaler-Post",
        seconds=sc.push_s if pushed else sc.te_list_poll_s / 2,
        what="the new TEs announced; JEs route to them",
        saved_by="proactive push" if pushed else "",
    )


def source_slowdown(cfg: Config, *, iteration_s: float, link_s: float) -> float:
    """The serving TE's TPOT factor while it is a fork's source (an estimate): its dies' UB
    link carries their own dispatch and combine (`link_s` of each `iteration_s`) and the fork;
    while both send, the fork takes cfg.scaling.fork_link_share of the link, so the dispatch
    and combine bytes take 1 / (1 - share) as long. Compute is not slowed: the NPU moves the
    fork's bytes with its own transfer engines (DeepServe §6.2: "contention is limited").
    `link_s` from the breakdown's dispatch and combine is an upper bound (it includes their
    kernel starts and waits, which the fork does not lengthen)."""
    if iteration_s <= 0 or not 0 <= link_s <= iteration_s:
        raise ConfigError(
            f"source_slowdown needs 0 <= link_s <= iteration_s and iteration_s > 0; got "
            f"link_s {link_s}, iteration_s {iteration_s}"
        )
    share = cfg.scaling.fork_link_share
    return 1 + link_s / iteration_s * share / (1 - share)
