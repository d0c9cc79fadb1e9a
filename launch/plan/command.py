"""`xds-mpi plan`: the deployment that meets an SLO at the lowest cost (docs/planning.md).

Sweep broadly (every deployment the chip budget holds, priced analytically with the workload's
arrivals replayed on its iteration cost), verify few (`--verify N`: the top N run by emulation
at a reduced width, on the virtual clock)."""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from launch.plan.outputs import plot, table, write_config
from xds_mpi.config.schema import ConfigError
from xds_mpi.planning.candidates import KINDS, Options
from xds_mpi.planning.frontier import Slo
from xds_mpi.planning.search import Planner, SearchResult
from xds_mpi.planning.workload import PlanWorkload, from_trace, synthetic

EPILOG = """\
workload: --trace FILE with --start/--duration/--speedup (a Mooncake JSONL window), or
  --synthetic PROMPT,OUTPUT with --rate (requests/s) and --duration.
what is searched: colocated EP sizes; PD prefill TEs (32 dies each, TP1 or TP4) against a
  colocated decode TE; afd attention:expert dies and DP domains behind PD prefill TEs; MTP depth;
  INT8 KV; each at the largest batch per DP group that fits in memory (weights + KV + reserve).
priced: the dies' own decode iteration (batch x KV length) and prefill pass, with the
  window's arrivals replayed (continuous batching; PD: prefill queue, KV transfer, decode).
ranked: goodput per chip (requests meeting the SLO per second per chip); the Pareto frontier of
  tokens/s per chip against TPOT p99 and TTFT p99 is printed, plotted (OUT/plan.png) and
  written as configs (OUT/frontier_N.yaml).
exit 2 with a message: an SLO no deployment meets (the closest, by how much), a workload no
  deployment's memory holds, a chip budget below one TE.
example: xds-mpi plan --trace ../shared/traces/conversation_trace.jsonl --start 600 \\
  --duration 60 --chips 96 --slo ttft=2s,tpot=35ms --verify 3"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity planner: the deployment with the most goodput per chip under an SLO",
        description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", help="Mooncake JSONL trace (docs/trace.md)")
    p.add_argument("--start", type=float, default=600.0, help="window start, trace s (600)")
    p.add_argument("--duration", type=float, default=60.0, help="window length, s (60)")
    p.add_argument("--speedup", type=float, default=1.0, help="trace s per served s (1)")
    p.add_argument("--synthetic", metavar="PROMPT,OUTPUT", help="fixed lengths instead of a trace")
    p.add_argument("--rate", type=float, default=1.0, help="synthetic requests/s (1)")
    p.add_argument("--slo", default="ttft=2s,tpot=35ms", help="ttft=<n>s|ms,tpot=<n>s|ms")
    p.add_argument("--chips", type=float, default=48, help="chip budget (910C: 2 dies a chip)")
    p.add_argument("--kinds", default=",".join(KINDS), help="of colocated,pd,afd")
    p.add_argument("--profile", default="ascend910c", help="hardware profile (configs/hardware/)")
    p.add_argument("--mtp", default="0,1", help="MTP depths to try (0,1)")
    p.add_argument("--accept", type=float, default=0.9, help="MTP acceptance per draft (0.9)")
    p.add_argument("--batches", default="16,32,64,96", help="batch limits per DP group to try")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table (10)")
    p.add_argument(
        "--find",
        default="",
        metavar="TEXT",
        help="also print the ranked rows whose label contains TEXT (e.g. EP288)",
    )
    p.add_argument(
        "--decode-only",
        action="store_true",
        help="requests arrive prefilled (the papers' decode figures); chips count "
        "the decode dies only",
    )
    p.add_argument("--out", default="plan_out", help="directory for plan.png and the configs")
    p.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="N",
        help="run the top N by emulation at a reduced width (0)",
    )
    p.add_argument(
        "--verify-requests",
        type=int,
        default=100,
        help="requests per emulation (100: goodput on a few moves in steps of one request)",
    )
    p.add_argument(
        "--verify-length-scale",
        type=float,
        default=0.02,
        help="lengths served in the emulations x this (0.02)",
    )
    p.add_argument("--timeout", type=float, default=240, help="seconds per emulation (240)")
    p.set_defaults(func=cmd_plan)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag}: want comma-separated integers, got {text!r}") from None


def workload_of(args: argparse.Namespace) -> PlanWorkload:
    if bool(args.trace) == bool(args.synthetic):
        raise ConfigError("give one workload: --trace FILE or --synthetic PROMPT,OUTPUT")
    if args.trace:
        return from_trace(
            args.trace, start_s=args.start, duration_s=args.duration, speedup=args.speedup
        )
    lengths = _ints(args.synthetic, "--synthetic")
    if len(lengths) != 2:
        raise ConfigError(f"--synthetic wants PROMPT,OUTPUT, got {args.synthetic!r}")
    return synthetic(
        prompt_len=lengths[0], output_len=lengths[1], rate=args.rate, duration_s=args.duration
    )


def options_of(args: argparse.Namespace) -> Options:
    return Options(
        mtp_depths=_ints(args.mtp, "--mtp"), max_batches=_ints(args.batches, "--batches")
    )


def check_result(result: SearchResult, slo: Slo) -> None:
    """ConfigError (exit 2) when nothing fits in memory or nothing meets the SLO."""
    if not result.ranked:
        reasons = Counter(e.reason for e in result.excluded).most_common(3)
        lines = "\n".join(f"  {n} x {why}" for why, n in reasons)
        raise ConfigError(
            f"no deployment in {result.num_dies} dies holds this workload in memory "
            f"({len(result.excluded)} tried); the commonest reasons:\n{lines}\n"
            "try more chips, --batches with smaller limits, or shorter requests"
        )
    if result.ranked[0].outcome.goodput_per_chip == 0:
        closest = min(result.ranked, key=lambda p: p.outcome.miss(slo))
        o = closest.outcome
        raise ConfigError(
            f"no deployment meets {slo} for any request; the closest is {closest.candidate.label}"
            f" ({o.chips:g} chips): TTFT p99 {o.ttft_p99_s:.2f} s "
            f"({o.ttft_p99_s / slo.ttft_s:.1f}x the SLO), TPOT p99 {o.tpot_p99_s * 1e3:.1f} ms "
            f"({o.tpot_p99_s / slo.tpot_s:.1f}x): {o.miss(slo):+.0%} over at its worst"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    started = time.monotonic()
    slo = Slo.parse(args.slo)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    workload = workload_of(args)
    planner = Planner(
        workload, slo, profile=args.profile, accept=args.accept, decode_only=args.decode_only
    )
    print(
        f"plan: {workload.source}: {workload.num_requests} requests, {workload.rate:.2f}/s, "
        f"mean prompt {workload.prompt_len.mean():.0f}, output {workload.output_len.mean():.0f} "
        f"tokens; {slo}; {args.chips:g} chips on {args.profile}",
        flush=True,
    )
    result = planner.search(
        args.chips, kinds, options_of(args), progress=lambda line: print(line, flush=True)
    )
    for why, n in Counter(e.reason.split(":")[0] for e in result.excluded).most_common(4):
        print(f"plan: excluded {n} x {why}")
    check_result(result, slo)
    print(f"\nranked by goodput per chip (top {args.top} of {len(result.ranked)}):")
    print(table(result.ranked[: args.top]))
    if args.find:
        found = [(n, p) for n, p in enumerate(result.ranked, 1) if args.find in p.candidate.label]
        print(f"\nranked rows with {args.find!r} ({len(found)}):")
        print(table([p for _, p in found][:20], ranks=[n for n, _ in found][:20]))
    print(
        f"\nPareto frontier, tokens/s per chip against TPOT p99 and TTFT p99 "
        f"({len(result.frontier)} points):"
    )
    print(table(result.frontier))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for n, p in enumerate(result.frontier, start=1):
        write_config(out / f"frontier_{n}.yaml", p, slo, workload.source)
    title = f"{workload.source}, {args.chips:g} chips, {slo}"
    plot(result.ranked, result.frontier, slo, out / "plan.png", title)
    print(
        f"plan: wrote {out / 'plan.png'} and {len(result.frontier)} configs "
        f"{out}/frontier_N.yaml; search {result.wall_s:.1f} s"
    )
    if args.verify:
        # here: the verification's launcher, only with --verify
        from launch.plan.verify import verify

        verify(args, planner, result.ranked[: args.verify], out)
    print(f"plan: {time.monotonic() - started:.1f} s in all")
    return 0
