"""`xds-mpi bench load`: one deployment served at several arrival rates on the virtual clock
(issue 58, docs/virtual_time.md): TTFT, TPOT and queueing percentiles and goodput against the
rate, a plot, and the knee beside the decode capacity `xds-mpi project` computes for the same
deployment.

Each rate is one `xds-mpi run` (Poisson arrivals, `workload.arrival=rate`) with `run.clock
virtual`, so every number in the table is on the dies' 910C clock, queueing included, and does
not depend on this machine's load. The served throughput is the requests over the virtual span
(first arrival at 0 to the last finish); the saturation throughput is its largest value over
the rates, and the knee the lowest rate whose served throughput reaches 95 % of it: beyond it
the rate only lengthens the queue. The capacity beside it is `project`'s decode-only ceiling:
every DP group full (`scheduler.max_batch_per_die`), one request leaving every mean-output-length
decode steps, at the served runs' mean KV length; the served run also prefills (chunked, in the
same iterations), which the ceiling does not price, so the knee sits below it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from launch.bench.results import report
from launch.serve.bench import run_launcher
from xds_mpi.config.paths import DEFAULT_CONFIG, resolve_config
from xds_mpi.config.schema import ConfigError, load_config

COLUMNS = ["rate_per_s", "requests", "queue_p50_ms", "queue_p99_ms", "ttft_p50_ms"]
COLUMNS += ["ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput", "served_req_s", "span_s"]
COLUMNS += ["wall_s"]
KNEE_SHARE = 0.95  # of the saturation throughput


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """`project`'s decode-only ceiling: requests/s at every DP group full (batch_per_die
    requests), tpot_s per token at kv_len (the decode iteration, less MTP's accepted drafts),
    one request out every output_len tokens."""

    requests_per_s: float
    tpot_s: float
    batch_per_die: int
    kv_len: float
    output_len: float


def serve_at(args: argparse.Namespace, rate: float) -> dict:
    """One run at `rate` requests/s; its row (the run file's /summary, virtual columns)."""
    with tempfile.TemporaryDirectory(prefix="xds-bench-load-") as tmp:
        sets = [
            "workload.arrival=rate",
            f"workload.rate_per_s={rate:g}",
            "run.clock=virtual",
            f"run.output_dir={tmp}",
            *args.set,
        ]
        command = [sys.executable, "-m", "launch.cli.main", "run", str(args.config)]
        command += [a for s in sets for a in ("--set", s)]
        done = run_launcher(command, cwd=Path.cwd(), env=None, timeout_s=args.timeout)
        if done.returncode:
            output = done.stdout + done.stderr
            raise SystemExit(f"bench load: the run at {rate:g}/s failed:\n{output[-3000:]}")
        (path,) = Path(tmp).glob("*.h5")
        return row_of(path, rate)


def row_of(path: Path, rate: float) -> dict:
    """The table's row from one run file (virtual clock), plus the lengths the capacity needs."""
    import h5py  # here: a measured start-up cost of every command

    with h5py.File(path, "r") as f:
        s = dict(f["summary"].attrs)
        requests = f["requests"]
        prompt = requests["prompt_len"][:].astype(float)
        tokens = requests["num_tokens"][:].astype(float)
    if s.get("serving_clock") != "virtual":
        raise SystemExit(f"bench load: {path} was served on the {s.get('serving_clock')} clock")
    num = int(s["num_served"])
    span_s = float(s["virtual_span_s"])
    return {
        "rate_per_s": rate,
        "requests": num,
        "queue_p50_ms": float(s["virtual_queue_ms_p50"]),
        "queue_p99_ms": float(s["virtual_queue_ms_p99"]),
        "ttft_p50_ms": float(s["virtual_ttft_ms_p50"]),
        "ttft_p99_ms": float(s["virtual_ttft_ms_p99"]),
        "tpot_p50_ms": float(s["virtual_tpot_ms_p50"]),
        "tpot_p99_ms": float(s["virtual_tpot_ms_p99"]),
        "goodput": float(s["virtual_goodput_fraction"]),
        "served_req_s": num / span_s if span_s > 0 else float("nan"),
        "span_s": span_s,
        "wall_s": float(s["wall_s"]),
        "mean_prompt": float(prompt.mean()),
        "mean_output": float(tokens.mean()),
    }


def knee(rows: list[dict]) -> tuple[float, float]:
    """(the saturation throughput, the lowest rate reaching KNEE_SHARE of it)."""
    best = max(r["served_req_s"] for r in rows)
    rate = min(r["rate_per_s"] for r in rows if r["served_req_s"] >= KNEE_SHARE * best)
    return best, rate


def capacity(
    config: Path, sets: list[str], rows: list[dict], *, accept_rate: float = 0.9
) -> Capacity:
    """`xds-mpi project`'s decode TPOT for this deployment at full batches and the served runs'
    mean lengths (with MTP, at `accept_rate`), as a request rate."""
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.model.shapes import cost_shape
    from xds_mpi.plan.topology import Topology
    from xds_mpi.projection.cost import Hardware
    from xds_mpi.projection.project import project

    cfg = load_config(config, sets)
    output = sum(r["mean_output"] for r in rows) / len(rows)
    kv_len = sum(r["mean_prompt"] for r in rows) / len(rows) + output / 2
    batch = cfg.scheduler.max_batch_per_die
    hw = Hardware.from_profile(load_profile(cfg.hardware.profile))
    depth = cfg.scheduler.mtp_depth
    p = project(
        cfg,
        cost_shape(),
        hw,
        batch_per_die=batch,
        kv_len=kv_len,
        mtp_depth=depth,
        accept_rate=accept_rate if depth else 0.0,
    )
    topo = Topology.from_config(cfg)
    groups = topo.num_dp_domains * topo.dp_groups_per_domain
    return Capacity(
        requests_per_s=groups * batch / (p.tpot_s * output),
        tpot_s=p.tpot_s,
        batch_per_die=batch,
        kv_len=kv_len,
        output_len=output,
    )


def plot(rows: list[dict], cap: Capacity, knee_rate: float, path: Path, title: str) -> None:
    """TTFT and TPOT p50/p99, and served throughput, against the rate (Agg: no display)."""
    # here: matplotlib, a measured start-up cost of every command
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate_per_s"] for r in rows]
    fig, (ax_ttft, ax_tpot, ax_tput) = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, name in ((ax_ttft, "ttft"), (ax_tpot, "tpot")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [r[f"{name}_{p}_ms"] for r in rows], style, label=p)
        ax.set_ylabel(f"virtual {name.upper()} (ms)")
        ax.legend()
    ax_tput.plot(rates, [r["served_req_s"] for r in rows], "o-", label="served")
    ax_tput.plot(rates, rates, ":", color="gray", label="offered")
    ax_tput.axhline(cap.requests_per_s, color="red", ls="--", label="project's decode ceiling")
    ax_tput.set_ylabel("requests/s (virtual)")
    ax_tput.set_ylim(0, max(cap.requests_per_s, max(r["served_req_s"] for r in rows)) * 1.2)
    ax_tput.legend(fontsize=8)
    for ax in (ax_ttft, ax_tpot, ax_tput):
        ax.set_xscale("log")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.axvline(knee_rate, color="orange", alpha=0.5)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_bench_load(args: argparse.Namespace) -> int:
    args.config = resolve_config(args.config)
    rates = sorted(set(args.rates))
    if not rates or rates[0] <= 0:
        raise ConfigError(f"bench load: --rates must be > 0, got {args.rates}")
    rows = []
    for rate in rates:
        rows.append(serve_at(args, rate))
        print(f"  served {rate:g} requests/s", flush=True)
    best, knee_rate = knee(rows)
    cap = capacity(args.config, args.set, rows, accept_rate=args.accept)
    args.profile = load_config(args.config, args.set).hardware.profile
    title = f"xds-mpi bench load: {args.config.name}, virtual clock"
    legend = (
        "virtual 910C clock, queueing included: queue = arrival -> admission, TTFT = arrival -> "
        "first token; goodput: share meeting run.slo_ttft_ms and run.slo_tpot_ms; served_req_s "
        "= requests / virtual span; wall_s: the emulator's serving time."
    )
    table = [{c: r[c] for c in COLUMNS} for r in rows]
    report(table, COLUMNS, args, title=title, legend=legend)
    print(
        f"saturation {best:.2f} requests/s served; knee at {knee_rate:g} requests/s offered "
        f"(the lowest rate served at >= {KNEE_SHARE:.0%} of it); xds-mpi project's decode "
        f"ceiling {cap.requests_per_s:.2f} requests/s ({cap.batch_per_die} requests per DP "
        f"group, TPOT {cap.tpot_s * 1e3:.1f} ms at KV length {cap.kv_len:.0f}, "
        f"{cap.output_len:.1f} output tokens per request): served/ceiling "
        f"{best / cap.requests_per_s:.2f}"
    )
    plot(rows, cap, knee_rate, Path(args.plot), title)
    print(f"plot: {args.plot}")
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser(
        "load",
        help="one deployment at several arrival rates on the virtual clock: TTFT/TPOT/goodput",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="a config (virtual clock)")
    p.add_argument(
        "--rates", type=float, nargs="+", default=[10, 20, 40, 80, 160], help="requests/s"
    )
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--accept", type=float, default=0.9, help="MTP acceptance for the ceiling (mtp_depth > 0)"
    )
    p.add_argument("--plot", default="bench_load.png", help="where the plot goes (PNG)")
    p.add_argument("--out", default="", help="write the table to FILE.csv or FILE.h5")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    p.set_defaults(func=cmd_bench_load)
