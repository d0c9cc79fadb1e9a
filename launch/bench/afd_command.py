"""`xds-mpi bench afd`: A2E/E2A with and without trampolines beside colocated dispatch/combine.

This module only parses and launches (no MPI in the CLI process); the per-rank program is
launch/bench/afd.py.
"""

from __future__ import annotations

import argparse
import sys

from launch.bench.command import run_bench
from launch.bench.results import add_row_options
from xds_mpi.config.schema import ConfigError


def add_parser(kinds) -> None:
    """Register `bench afd` under the `bench` subcommand's parsers."""
    p = kinds.add_parser(
        "afd",
        help="A2E/E2A with and without trampolines vs dispatch/combine",
        description="Latency of A2E and E2A (one DP domain of --groups attention"
        " dies, the other ranks expert dies, identity experts) with "
        "trampoline forwarding and without it, beside colocated "
        "dispatch/combine over all ranks moving the same tokens, "
        "in the same run; metadata records written per attention "
        "die; the projected 910C round from the virtual clock.",
    )
    p.add_argument("--np", type=int, default=12, help="ranks (default 12)")
    p.add_argument(
        "--groups",
        type=int,
        default=0,
        help="attention dies of the domain (default: a third of --np)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[16, 64],
        help="tokens per attention die (default: 16 64)",
    )
    add_row_options(p)
    p.set_defaults(func=cmd_bench_afd)


def cmd_bench_afd(args: argparse.Namespace) -> int:
    groups = args.groups or max(1, args.np // 3)
    _check_shape(args, groups)
    return run_bench(args, _rank_program(args, groups))


def _check_shape(args: argparse.Namespace, groups: int) -> None:
    """Refuse a domain without enough expert dies, or experts fewer than top-k or expert dies."""
    if args.np < 2 or not 1 <= groups <= args.np - groups:
        raise ConfigError(
            f"bench afd: --groups({groups}) attention dies need as many expert dies"
            f" at least: --np({args.np}) - groups = {args.np - groups}"
        )
    if args.topk > args.experts or args.experts < args.np - groups:
        raise ConfigError(
            f"bench afd: --experts({args.experts}) must be >= --topk({args.topk}) "
            f"and >= the {args.np - groups} expert dies"
        )


def _rank_program(args: argparse.Namespace, groups: int) -> list[str]:
    """The per-rank command line: launch.bench.afd under `python -m mpi4py`."""
    program = [
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "launch.bench.afd",
        "--groups",
        str(groups),
        "--hidden",
        str(args.hidden),
        "--topk",
        str(args.topk),
        "--experts",
        str(args.experts),
        "--iters",
        str(args.iters),
        "--profile",
        args.profile,
        "--out",
        args.out,
        "--tokens",
        *map(str, args.tokens),
    ]
    program += ["--int8"] if args.int8 else []
    return program
