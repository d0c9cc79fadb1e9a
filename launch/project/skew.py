"""`xds-mpi project --skew`: expert load skew at pod scale, with and without EPLB (xDeepServe
Figure 11), beside the uniform projection (xds_mpi/projection/eplb_pod.py)."""

from __future__ import annotations

import argparse

from launch.report.tables import format_table
from xds_mpi.config.schema import ConfigError
from xds_mpi.eplb.drift import DRIFT_OTHER_TRAFFIC, DRIFT_SAME_REQUESTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert load skew (Figure 11; xds_mpi/eplb/skew.py)")
    g.add_argument(
        "--skew",
        type=float,
        default=0.0,
        metavar="HOTTEST",
        help="price a skewed routing whose hottest expert gets HOTTEST x the mean (Fig. 11a: 30)",
    )
    g.add_argument("--skew-share", type=float, default=0.2, help="share of experts above the mean")
    g.add_argument("--skew-slices", type=int, default=4, help="time slices the policies see")
    g.add_argument(
        "--skew-drift",
        type=float,
        default=DRIFT_SAME_REQUESTS,
        help="sigma of an expert's log load change per slice (default: measured on the trained "
        f"checkpoint for a fixed set of requests, {DRIFT_SAME_REQUESTS}; another workload's "
        f"traffic: {DRIFT_OTHER_TRAFFIC})",
    )
    g.add_argument("--skew-seed", type=int, default=0)


def print_skew(args: argparse.Namespace, cfg, m, hw, workload: dict) -> None:
    """The comparison table: forward time per iteration and the routed dies' straggler."""
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.eplb.skew import Skew
    from xds_mpi.projection.eplb_pod import compare

    if args.skew_slices < 1 or args.skew_drift < 0:
        raise ConfigError(
            f"need --skew-slices >= 1 and --skew-drift >= 0; got {args.skew_slices}, "
            f"{args.skew_drift}"
        )
    skew = Skew(
        hottest_over_mean=args.skew,
        share_above_mean=args.skew_share,
        num_slices=args.skew_slices,
        drift_sigma=args.skew_drift,
        seed=args.skew_seed,
    )
    try:
        results = compare(cfg, m, hw, skew, **workload)
    except ValueError as exc:  # a skew no routing can have, or a placement refused
        raise ConfigError(f"--skew: {exc}") from None
    native = next(r for r in results if r.name.startswith("MoE-Native"))
    print(
        f"skew: hottest expert {skew.hottest_over_mean:g}x the mean, "
        f"{skew.share_above_mean:.0%} of experts above it; policies see {skew.num_slices} "
        f"slices, priced on the next (log loads drift by {skew.drift_sigma:g} per slice); "
        f"{cfg.deployment.redundant_slots_per_die} redundant slot(s) per routed die"
    )
    rows = [
        [
            r.name,
            f"{r.forward_s * 1e3:.1f}",
            f"{1 - r.forward_s / native.forward_s:+.0%}",
            f"{r.max_over_mean:.2f}",
            f"{r.experts_s * 1e6:.0f}",
        ]
        for r in results
    ]
    headers = ["routing", "forward ms", "gain vs native", "max/mean die", "experts us/layer"]
    print(format_table(headers, rows))
