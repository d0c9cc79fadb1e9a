"""`xds-mpi project`: the analytic projection of a deployment's decode iteration on the pod."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from launch.project.afd import add_arguments as add_afd_arguments
from launch.project.afd import print_afd
from launch.project.paper import add_arguments as add_paper_arguments
from launch.project.paper import (
    add_model_arguments,
    model_inputs,
    print_context_cache,
    print_paper,
    print_primitive,
)
from launch.project.scaling import add_arguments as add_scaling_arguments
from launch.project.scaling import print_scaling
from launch.project.skew import add_arguments as add_skew_arguments
from launch.project.skew import print_skew
from launch.project.sweep import add_arguments as add_sweep_arguments
from launch.project.sweep import run_sweep
from launch.report.tables import format_table
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.model.shapes import load_model_preset

if TYPE_CHECKING:
    from xds_mpi.config.schema import Config
    from xds_mpi.projection.project import Projection


def add_parser(sub) -> None:
    p = sub.add_parser(
        "project",
        help="project a decode iteration onto the pod (no launch)",
        description="Price one decode iteration of CONFIG at the cost shape "
        "(DeepSeek-V3) on the hardware profile, analytically: works "
        "for pod-scale deployments (768 dies) that do not fit here.",
    )
    p.add_argument("config", nargs="?", default="colocated")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--batch", type=int, default=60, help="requests per DP group (default 60)")
    p.add_argument("--kv-len", type=int, default=3072, help="mean KV length (default 3072)")
    p.add_argument("--mtp", type=int, default=1, help="MTP depth (default 1)")
    p.add_argument("--accept", type=float, default=0.9, help="MTP acceptance (default 0.9)")
    p.add_argument("--shape", default="deepseek_v3", help="cost shape preset (configs/model/)")
    add_model_arguments(p)
    add_skew_arguments(p)
    add_paper_arguments(p)
    add_afd_arguments(p)
    add_sweep_arguments(p)
    add_scaling_arguments(p)
    p.set_defaults(func=cmd_project)


def cmd_project(args: argparse.Namespace) -> int:
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.projection.cost import Hardware
    from xds_mpi.projection.project import project

    if args.afd_analysis:
        return print_afd(args)
    if args.paper:
        return print_paper(args)
    if args.primitive:
        return print_primitive(args)
    if args.context_cache:
        return print_context_cache(args)
    if args.scaling:
        return print_scaling(args)
    if args.batch < 1 or args.kv_len < 1 or args.mtp < 0 or not 0 <= args.accept <= 1:
        raise ConfigError(
            f"need --batch >= 1, --kv-len >= 1, --mtp >= 0, 0 <= --accept <= 1; "
            f"got {args.batch}, {args.kv_len}, {args.mtp}, {args.accept}"
        )
    if args.sweep:
        return run_sweep(
            args, resolve_config(args.config), load_model_preset(args.shape), model_inputs
        )
    cfg = load_config(resolve_config(args.config), args.set)
    hw = Hardware.from_profile(load_profile(cfg.hardware.profile))
    m = load_model_preset(args.shape)
    inputs = model_inputs(args, cfg, m)
    p = project(
        cfg,
        m,
        hw,
        batch_per_die=args.batch,
        kv_len=args.kv_len,
        mtp_depth=args.mtp,
        accept_rate=args.accept,
        **inputs,
    )
    _print_imbalance(inputs["imbalance"])
    _print_projection(args, cfg, p)
    if args.config == "ep288":
        _print_against_000(p, cfg.hardware.profile)
    if args.skew:
        workload = dict(
            batch_per_die=args.batch,
            kv_len=args.kv_len,
            mtp_depth=args.mtp,
            accept_rate=args.accept,
        )
        print_skew(args, cfg, load_model_preset(args.shape), hw, workload)
    return 0


def chip_word(profile: str) -> str:
    """What a "chip" of tokens/s per chip is on `profile`: an H800 is one GPU ([001] Table 4
    counts per GPU; the projection divides by the profile's die.dies_per_chip, 1), a 910C
    package two dies."""
    return "GPU" if profile.startswith("h800") else "chip"


def _print_imbalance(imb) -> None:
    print(f"slowest die: expert load {imb.moe:.2f}x, KV {imb.kv:.3f}x the mean ({imb.source})")


def _print_projection(args: argparse.Namespace, cfg: Config, p: Projection) -> None:
    """The deployment and workload, the iteration's totals, then the two breakdown tables."""
    print(
        f"{args.config}: {cfg.deployment.kind}, batch {args.batch} per DP group, KV length "
        f"{args.kv_len}, MTP depth {args.mtp} at {args.accept:.0%} acceptance, "
        f"shape {args.shape}, profile {cfg.hardware.profile}"
    )
    print(
        f"iteration {p.iteration_s * 1e3:.1f} ms, TPOT {p.tpot_s * 1e3:.1f} ms, "
        f"{p.tokens_per_s_per_chip:.0f} tokens/s per {chip_word(cfg.hardware.profile)}"
    )
    rows = [
        [name, f"{s * 1e3:.2f}", f"{s / p.iteration_s:.0%}"] for name, s in p.breakdown_s.items()
    ]
    print(format_table(["operation (per iteration)", "ms", "share"], rows))
    print(
        format_table(
            ["primitive (one call)", "us"],
            [[name, f"{s * 1e6:.1f}"] for name, s in p.primitives_s.items()],
        )
    )


def _print_against_000(p: Projection, profile: str) -> None:
    """[000] §7.1's TPOT for its DP288/EP288 run beside this projection and beside the paper
    scenario as `--paper --profile <profile>` prices it (the command's defaults are the run's
    batch, KV length and MTP; the scenario adds what §4.7 and Figures 11a/20 say of the run)."""
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.projection.paper_data import VALIDATION
    from xds_mpi.projection.paper_table import scenario_projection

    pub = next(r for r in VALIDATION if (r.scenario, r.metric) == ("000 colocated", "tpot"))
    paper = scenario_projection(pub.scenario, profile).tpot_s * 1e3
    mine = p.tpot_s * 1e3
    print(
        f"against [000] §7.1 (DP288/EP288, batch 60, ~3K, MTP 90 %): TPOT ~{pub.value:g} ms "
        f"({pub.derived_from}); this projection {mine:.1f} ms ({mine / pub.value - 1:+.0%}); "
        f"the paper's scenario as --paper prices it {paper:.1f} ms ({paper / pub.value - 1:+.0%})"
    )
    _print_ep288_gap(profile)


def _print_ep288_gap(profile: str) -> None:
    """The gap to [000] §7.1 term by term (xds_mpi/projection/ep288_gap.py): each priced
    mechanism added in turn with its band, then the published terms beside each rung's."""
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.projection import ep288_gap as gap

    steps = gap.ladder(profile)
    published = gap.published_terms()
    print(f"the gap, mechanism by mechanism (TPOT ms; published {gap.published_tpot_ms():.1f}):")
    for s in steps:
        lo, hi = s.band_ms
        print(f"  + {s.added}: {s.tpot_ms:.1f} (its input's ends {lo:.1f}-{hi:.1f})")
    header = ["term (ms per iteration)", "published"] + [f"rung {i}" for i in range(len(steps))]
    mine = [gap.projected_terms(s.projection) for s in steps]
    rows = [[k, f"{v:.1f}"] + [f"{t[k]:.1f}" for t in mine] for k, v in published.items()]
    rows.append(["iteration + gap", f"{sum(published.values()):.1f}"]
                + [f"{sum(t.values()):.1f}" for t in mine])  # fmt: skip
    print(format_table(header, rows))
