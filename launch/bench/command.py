"""`xds-mpi bench p2p` and `xds-mpi bench ep`: their options and mpiexec lines."""

from __future__ import annotations

import argparse
import sys

from launch.bench import recovery
from launch.bench.results import add_row_options
from launch.job.mpiexec import LAUNCH_GRACE_S, mpi_command, run_job
from xds_mpi.config.schema import ConfigError


def add_parsers(kinds) -> None:
    _add_bench_p2p(kinds)
    _add_bench_ep(kinds)
    recovery.add_parser(kinds)


def cmd_bench_p2p(args: argparse.Namespace) -> int:
    if args.np < 2 or args.np % 2:
        raise ConfigError(f"bench p2p pairs ranks up: --np must be even and >= 2, got {args.np}")
    program = [
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "launch.bench.p2p",
        "--mode",
        args.mode,
        "--iters",
        str(args.iters),
        "--slots",
        str(args.slots),
        "--slot-bytes",
        str(args.slot_bytes),
        "--profile",
        args.profile,
        "--out",
        args.out,
        "--sizes",
        *map(str, args.sizes),
        "--cores",
        *map(str, args.cores),
    ]
    return run_bench(args, program)


def cmd_bench_ep(args: argparse.Namespace) -> int:
    if args.np < 1:
        raise ConfigError(f"bench ep needs --np >= 1, got {args.np}")
    if args.experts % args.np or args.topk > args.experts:
        raise ConfigError(
            f"bench ep: --experts({args.experts}) must be a multiple of --np"
            f"({args.np}) and >= --topk({args.topk})"
        )
    program = [
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "launch.bench.ep",
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
    ] + (["--int8"] if args.int8 else [])
    return run_bench(args, program)


def run_bench(args: argparse.Namespace, program: list[str]) -> int:
    command = mpi_command(args.np, program, timeout_s=args.timeout)
    print(f"xds-mpi: bench {args.kind} on {args.np} ranks: {command.shell_line()}", flush=True)
    result = run_job(command, timeout_s=args.timeout + LAUNCH_GRACE_S)
    if result.stopped_by is not None:
        return result.returncode  # 128 + signo; mpiexec and its ranks already ended
    if result.timed_out:
        print(f"xds-mpi: error: bench exceeded --timeout {args.timeout:g} s", file=sys.stderr)
        return 124
    return result.returncode


def _add_bench_p2p(kinds) -> None:
    p = kinds.add_parser(
        "p2p",
        help="XCCL send/receive vs raw Put and Send/Recv ping-pong",
        description="Latency and bandwidth of XCCL send/receive against a raw "
        "MPI Put+Flush+flag ping-pong and a Send/Recv ping-pong of "
        "the same sizes, measured in the same run, plus the "
        "projected 910C send latency from the virtual clock. Ranks "
        "pair up; all pairs run at once.",
    )
    p.add_argument("--np", type=int, default=2, help="ranks (even; default 2)")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[64, 4096, 65536, 1 << 20, 8 << 20],
        help="message sizes in bytes (default: 64 4096 65536 1MiB 8MiB)",
    )
    p.add_argument(
        "--cores", type=int, nargs="+", default=[2], help="AIV cores per transfer (default: 2)"
    )
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument(
        "--iters",
        type=int,
        default=200,
        help="iterations for small messages (fewer for large ones; default 200)",
    )
    p.add_argument("--slots", type=int, default=8, help="ring slots (default 8)")
    p.add_argument("--slot-bytes", type=int, default=1 << 20, help="bytes per slot (default 1MiB)")
    p.add_argument("--profile", default="ascend910c", help="hardware profile for the projection")
    p.add_argument("--out", default="", help="write the table to FILE.csv or FILE.h5")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the job is killed")
    p.set_defaults(func=cmd_bench_p2p)


def _add_bench_ep(kinds) -> None:
    p = kinds.add_parser(
        "ep",
        help="XCCL dispatch+combine vs Alltoall+Alltoallv",
        description="Latency of one dispatch + combine round (identity experts, "
        "random top-k routing) against a two-sided baseline moving "
        "the same rows (Alltoall of counts + Alltoallv there and "
        "back) in the same run, plus the projected 910C latency.",
    )
    p.add_argument("--np", type=int, default=8, help="ranks (default 8)")
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[16, 64, 128],
        help="tokens per die (default: 16 64 128)",
    )
    add_row_options(p)
    p.set_defaults(func=cmd_bench_ep)
