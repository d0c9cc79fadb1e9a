"""`xds-mpi bench serve`: the main job served end to end, timed where the time goes.

For each die count the main job (a colocated config, by default configs/colocated.yaml with
`--requests-per-die` requests per die) is served once per repeat; the table gives tokens/s, the
median iteration and, per MoE layer per die, wall time split into Python, MPI window calls and
waiting for peers (launch/serve/stats.py). `--against DIR` serves the same jobs from another
checkout (e.g. a worktree of main) alternating with this one, so both see the same load.
`--jitter` serves each die count under the `emulator` settings with and without GC control and
core pinning and reports each die's wait in the first dispatch of every iteration.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from launch.bench.results import report
from launch.job.startup import RANK_STATS_ENV
from launch.serve.stats import ServeStats, summarize
from xds_mpi.config.paths import DEFAULT_CONFIG, resolve_config
from xds_mpi.config.schema import ConfigError

COLUMNS = ["dies", "source", "tokens_s", "vs_against", "iter_ms", "moe_layer_ms", "python_ms"]
COLUMNS += ["mpi_ms", "wait_ms", "startup_s", "cpu_rank_s", "pss_rank_mib", "pss_gib"]
COLUMNS += ["proj_iter_ms", "slowdown", "serving_share"]
JITTER_COLUMNS = ["dies", "gc", "pin_cores", "samples", "wait_p50_ms", "wait_p99_ms", "tokens_s"]
# (emulator.gc, pinned?): without either, GC control only, pinning only, both.
VARIANTS = (("default", False), ("controlled", False), ("default", True), ("controlled", True))


def serve(args, dies: int, source: Path | None, extra: list[str]) -> ServeStats:
    """One served run: this checkout (source None) or another one; its numbers."""
    with tempfile.TemporaryDirectory(prefix="xds-bench-serve-") as tmp:
        sets = [
            f"deployment.dp_groups_per_domain={dies}",
            f"workload.num_requests={args.requests_per_die * dies}",
            f"run.output_dir={tmp}",
            "run.trace=true",
            *args.set,
            *extra,
        ]
        command = [sys.executable, "-m", "launch.cli", "run", str(args.config)]
        command += [a for s in sets for a in ("--set", s)]
        from xccl.wake import TIME_MPI_ENV  # here: xccl imports mpi4py.MPI, which starts MPI

        env = dict(os.environ, **{TIME_MPI_ENV: "1", RANK_STATS_ENV: tmp})
        cwd = Path.cwd()
        if source is not None:
            env["PYTHONPATH"] = str(source)
            cwd = source
        started = time.perf_counter()
        done = run_launcher(command, cwd=cwd, env=env, timeout_s=args.timeout)
        wall_s = time.perf_counter() - started
        output = done.stdout + done.stderr
        if done.returncode:
            raise SystemExit(f"bench serve: the run failed ({done.returncode}):\n{output[-3000:]}")
        return summarize(output, Path(tmp), wall_s)


def run_launcher(command: list[str], *, cwd: Path, env: dict, timeout_s: float):
    """`xds-mpi run` as a child; past the timeout it gets SIGTERM, so that it ends its MPI job
    (a SIGKILL, what subprocess.run sends, would leave mpiexec and the ranks running)."""
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def median_row(dies: int, source: str, runs: list[ServeStats], base: float | None) -> dict:
    med = {k: float(np.median([getattr(r, k) for r in runs])) for k in _FIELDS}
    return {
        "dies": dies,
        "source": source,
        "tokens_s": med["tokens_per_s"],
        "vs_against": med["tokens_per_s"] / base if base else float("nan"),
        "iter_ms": med["iteration_ms"],
        "moe_layer_ms": med["moe_layer_ms"],
        "python_ms": med["python_ms"],
        "mpi_ms": med["mpi_ms"],
        "wait_ms": med["wait_ms"],
        "startup_s": med["startup_s"],
        "cpu_rank_s": med["cpu_per_rank_s"],
        "pss_rank_mib": med["pss_per_rank_mib"],
        "pss_gib": med["pss_total_gib"],
        "proj_iter_ms": med["projected_iteration_ms"],
        "slowdown": med["iteration_ms"] / med["projected_iteration_ms"],
        "serving_share": med["serving_s"] / med["wall_s"],
    }


_FIELDS = ("tokens_per_s", "iteration_ms", "moe_layer_ms", "python_ms", "mpi_ms", "wait_ms")
_FIELDS += ("startup_s", "cpu_per_rank_s", "pss_per_rank_mib", "pss_total_gib")
_FIELDS += ("projected_iteration_ms", "serving_s", "wall_s")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    args.config = resolve_config(args.config)
    if min(args.dies) < 1 or args.repeat < 1 or args.requests_per_die < 1:
        raise ConfigError("bench serve: --dies, --repeat and --requests-per-die must be >= 1")
    if args.jitter:
        return _jitter(args)
    rows = []
    for dies in args.dies:
        mine, theirs = [], []
        for _ in range(args.repeat):  # alternate, so both see the same load
            mine.append(serve(args, dies, None, []))
            if args.against:
                theirs.append(serve(args, dies, args.against, []))
            print(f"  served {dies} dies", flush=True)
        base = float(np.median([r.tokens_per_s for r in theirs])) if theirs else None
        rows.append(median_row(dies, "this", mine, base))
        if theirs:
            rows.append(median_row(dies, "against", theirs, base))
    report(rows, COLUMNS, args, title=_title(args), legend=_LEGEND)
    return 0


def _jitter(args: argparse.Namespace) -> int:
    rows = []
    for dies in args.dies:
        runs = {variant: [] for variant in VARIANTS}
        for _ in range(args.repeat):  # variants alternate, so each sees the same load
            for gc_mode, pinned in VARIANTS:
                pin = args.pin_mode if pinned else "never"
                extra = [f"emulator.gc={gc_mode}", f"emulator.pin_cores={pin}"]
                runs[(gc_mode, pinned)].append(serve(args, dies, None, extra))
            print(f"  served {dies} dies under {len(VARIANTS)} settings", flush=True)
        for (gc_mode, pinned), done in runs.items():
            waits = np.concatenate([r.first_dispatch_wait_ms for r in done])
            rows.append(
                {
                    "dies": dies,
                    "gc": gc_mode,
                    "pin_cores": args.pin_mode if pinned else "never",
                    "samples": len(waits),
                    "wait_p50_ms": float(np.percentile(waits, 50)),
                    "wait_p99_ms": float(np.percentile(waits, 99)),
                    "tokens_s": float(np.median([r.tokens_per_s for r in done])),
                }
            )
    legend = (
        "wait_p50/p99_ms: each die's wait in the first dispatch of every iteration. "
        f"pin_cores auto pins only when a node has >= as many cores ({os.cpu_count()} here) "
        "as ranks."
    )
    report(rows, JITTER_COLUMNS, args, title=_title(args) + ", jitter", legend=legend)
    return 0


def _title(args) -> str:
    against = f", against {args.against}" if args.against else ""
    return (
        f"xds-mpi bench serve: {args.config.name}, {args.requests_per_die} requests per die, "
        f"median of {args.repeat}{against}"
    )


_LEGEND = (
    "per MoE layer per die: moe_layer_ms = python_ms + mpi_ms (MPI window calls outside waits; "
    "nan where the source does not time them) + wait_ms (waiting for peers); iter_ms: median "
    "iteration; vs_against: tokens/s / the other checkout's. startup_s: launch to every rank "
    "built; cpu_rank_s / pss_rank_mib: a rank's CPU seconds and PSS then (median), pss_gib: all "
    "ranks'; proj_iter_ms: the projected iteration on the pod; slowdown: iter_ms / proj_iter_ms "
    "(the emulation's); serving_share: serving time / the run's wall time (nan: the checkout "
    "does not report it)."
)


def add_parser(kinds) -> None:
    p = kinds.add_parser(
        "serve",
        help="the main job's tokens/s and time per MoE layer (Python / MPI / waiting)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="a colocated config")
    p.add_argument("--dies", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--requests-per-die", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="runs per point (median)")
    p.add_argument("--against", type=Path, default=None, help="another checkout to compare")
    p.add_argument("--jitter", action="store_true", help="GC control and pinning on and off")
    p.add_argument(
        "--pin-mode",
        choices=["auto", "always"],
        default="auto",
        help="emulator.pin_cores of --jitter's pinned runs (always: even with fewer cores)",
    )
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", default="", help="write the table to FILE.csv or FILE.h5")
    p.add_argument("--profile", default="ascend910c", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.set_defaults(func=cmd_bench_serve)
