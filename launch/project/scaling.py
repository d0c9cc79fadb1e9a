"""`xds-mpi project --scaling`: DeepServe's five scaling steps per TE-Load path for one scale-out
event, NPU-fork's fan-out and its source's slowdown, and CloudMatrix-Infer Table 2 as validation
rows (xds_mpi/scaling/, docs/scaling.md)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from launch.report.tables import format_table
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.scaling import LOAD_PATHS
from xds_mpi.config.schema import Config, ConfigError, load_config
from xds_mpi.scaling.steps import STEP_NAMES, scale_out, source_slowdown
from xds_mpi.scaling.validation import fit_obs_efficiency, validate

FORK_RECEIVERS = (1, 8, 32)  # DeepServe Figure 11a: up to 32 TEs from one source
# DeepServe's optimizations (§6.1-6.2, Table 2), all off: its "before" case of Figure 9.
UNOPTIMIZED = dict(
    prewarmed_pods=False,
    prewarmed_tes=False,
    parallel_init=False,
    offline_profiling=False,
    proactive_push=False,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fast scaling (xds_mpi/scaling/, docs/scaling.md)")
    g.add_argument(
        "--scaling",
        action="store_true",
        help="the five scaling steps per TE-Load path and [001] Table 2's validation rows",
    )
    g.add_argument("--path", choices=LOAD_PATHS, help="one TE-Load path (default: all four)")
    g.add_argument("--new-tes", type=int, default=8, help="TEs activated at once (default 8)")
    g.add_argument(
        "--dies", type=int, default=32, help="dies of each new TE (default 32, an EP32 instance)"
    )


def print_scaling(args: argparse.Namespace) -> int:
    if args.new_tes < 1 or args.dies < 1:
        raise ConfigError(f"need --new-tes >= 1 and --dies >= 1; got {args.new_tes}, {args.dies}")
    cfg = load_config(resolve_config(args.config), args.set)
    paths = (args.path,) if args.path else LOAD_PATHS
    first = scale_out(cfg, num_dies=args.dies, num_new_tes=args.new_tes)
    print(
        f"{args.new_tes} new TE(s) of {args.dies} dies, {first.load.bytes_per_die / 1e9:.1f} GB "
        f"of weights per die (DeepSeek-V3, profile {cfg.hardware.profile}), seconds:"
    )
    _print_steps(cfg, args, paths, "as configured")
    unoptimized = replace(cfg, scaling=replace(cfg.scaling, **UNOPTIMIZED))
    _print_steps(unoptimized, args, paths, "DeepServe's optimizations off")
    if "fork" in paths:
        _print_fork(cfg, args)
    _print_validation(cfg)
    return 0


def _print_steps(cfg: Config, args: argparse.Namespace, paths: tuple[str, ...], title: str):
    rows = []
    for path in paths:
        one = replace(cfg, scaling=replace(cfg.scaling, path=path))
        timeline = scale_out(one, num_dies=args.dies, num_new_tes=args.new_tes)
        rows.append([path] + [f"{s:.2f}" for _, s in timeline.steps] + [f"{timeline.total_s:.2f}"])
    print(format_table([title, *STEP_NAMES, "total"], rows))
    print()


def _print_fork(cfg: Config, args: argparse.Namespace) -> None:
    """TE-Load of a fork to 1, 8, 32 TEs, relayed (fan-out 1) or all from the source, and the
    source's TPOT while it forks (its decode iteration as `xds-mpi project` prices it)."""
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.model.shapes import load_model_preset
    from xds_mpi.projection.cost import Hardware
    from xds_mpi.projection.project import project

    fork = replace(cfg, scaling=replace(cfg.scaling, path="fork"))
    rows = []
    for n in sorted({*FORK_RECEIVERS, args.new_tes}):
        chain = scale_out(fork, num_dies=args.dies, num_new_tes=n, fanout=1).load.seconds
        flat = scale_out(fork, num_dies=args.dies, num_new_tes=n, fanout=n).load.seconds
        rows.append([str(n), f"{chain:.3f}", f"{flat:.3f}"])
    print(format_table(["fork to TEs", "TE-Load s, relayed", "TE-Load s, source to all"], rows))
    p = project(
        cfg,
        load_model_preset(args.shape),
        Hardware.from_profile(load_profile(cfg.hardware.profile)),
        batch_per_die=args.batch,
        kv_len=args.kv_len,
        mtp_depth=args.mtp,
        accept_rate=args.accept,
    )
    link_s = sum(s for name, s in p.breakdown_s.items() if name.endswith(("dispatch", "combine")))
    factor = source_slowdown(cfg, iteration_s=p.iteration_s, link_s=link_s)
    print(
        f"the source ({args.config}, batch {args.batch}, KV {args.kv_len}): dispatch + combine "
        f"{link_s * 1e3:.1f} of {p.iteration_s * 1e3:.1f} ms per iteration; TPOT "
        f"{p.tpot_s * 1e3:.1f} ms before the fork, {p.tpot_s * factor * 1e3:.1f} ms during it "
        f"(x{factor:.3f}, at most, the fork taking {cfg.scaling.fork_link_share:.0%} of the link)"
    )
    print()


def _print_validation(cfg: Config) -> None:
    rows = [
        [v.row.what, f"{v.row.published_s:g}", f"{v.projected_s:.1f}", f"{v.error:+.1%}",
         f"{v.nominal_s:.1f}", v.role]
        for v in validate(cfg)
    ]  # fmt: skip
    headers = ["[001] Table 2 (671 GB, TE-Load)", "published s", "model s", "error",
               "nominal OBS s", "role"]  # fmt: skip
    print(format_table(headers, rows))
    print(
        f"obs_efficiency {cfg.scaling.obs_efficiency:g} (the EMS cold start's fit: "
        f"{fit_obs_efficiency(cfg):.3f}); nominal: the bucket's {cfg.scaling.obs_gb_per_s:g} GB/s, "
        "nothing fitted"
    )
