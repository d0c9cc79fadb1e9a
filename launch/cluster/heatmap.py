"""`xds-mpi heatmap`: DeepServe's PD-vs-colocated heatmap (§5.3.1, Figure 6; docs/heatmap.md)
made on the emulator's virtual clock.

For every cell of prompt length x decode/prompt ratio x request rate, a batch of identical
requests (a Mooncake trace written per cell) is served twice, each an `xds-mpi run`, one after
the other: on a PD pair (1 prefill die + 1 decode die, configs/pd.yaml shrunk) and on a
colocated TE of the same 2 dies (configs/colocated.yaml, DP2). The cell is JCT(colocated) /
JCT(PD) - 1 with each JCT the batch's mean finish - arrival on the virtual clock. The maps are
summed over the rates (the map `pd_heatmap` reads) and written with xds_mpi/cluster/heatmap.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launch.serve.bench import run_launcher
from xds_mpi.cluster.heatmap import Heatmap, write_heatmap
from xds_mpi.cluster.heatmap_study import (
    Cell,
    build_heatmap,
    gain,
    grid,
    read_mean_jct,
    write_trace,
)

DEEPSERVE_SIGN_STABLE = 0.80  # §5.3.1: "over 80 %" of the cells keep their sign across RPS
KV_BLOCK_TOKENS = 16  # scheduler.kv_block_tokens' default, which the study keeps


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """One side of a cell: a shipped config and the --set values that shrink it to the study's
    dies."""

    name: str
    config: str
    sets: tuple[str, ...]


PD = Deployment(
    name="pd",
    config="pd",
    sets=("deployment.num_prefill_dies=1", "deployment.dp_groups_per_domain=1"),
)
COLOCATED = Deployment(
    name="colocated", config="colocated", sets=("deployment.dp_groups_per_domain=2",)
)
DEPLOYMENTS = (COLOCATED, PD)


def study_sets(args: argparse.Namespace, trace: Path, out_dir: Path, name: str) -> list[str]:
    """What every run of the study sets beside its deployment's: the cell's trace served at the
    lengths it names, every request to its full output, on the virtual clock; a die holds the
    whole batch (slots and KV: memory is not what the study compares); no heartbeat detection
    (a fence on a slow turn of this machine would price a failover into the virtual times)."""
    max_total = max(args.prompts) * (1 + max(args.ratios))
    kv_blocks = math.ceil(args.requests * max_total / KV_BLOCK_TOKENS)
    return [
        "workload.source=trace",
        f"trace.path={trace}",
        "trace.length_scale=1",
        "workload.ignore_eos=true",
        f"workload.seed={args.seed}",
        "run.clock=virtual",
        "run.trace=false",
        "health.enabled=false",
        f"scheduler.max_batch_per_die={args.requests}",
        f"scheduler.num_kv_blocks_per_die={kv_blocks}",
        f"scheduler.prefill_chunk_tokens={args.chunk_tokens}",
        f"xccl.max_tokens_per_die={args.chunk_tokens}",
        f"run.output_dir={out_dir}",
        f"run.name={name}",
        *args.set,
    ]


def run_side(args: argparse.Namespace, cell: Cell, side: Deployment, tmp: Path) -> float:
    """One `xds-mpi run` of the cell's batch on one deployment: its mean JCT (virtual s).
    RuntimeError naming the run and its last output lines when it fails."""
    trace = tmp / f"{cell.name}.jsonl"
    write_trace(trace, cell, args.requests)
    name = f"{cell.name}_{side.name}"
    sets = [*side.sets, *study_sets(args, trace, tmp, name)]
    command = [sys.executable, "-m", "launch.cli.main", "run", side.config]
    command += [a for s in sets for a in ("--set", s)]
    done = run_launcher(command, cwd=Path.cwd(), env=None, timeout_s=args.timeout)
    path = tmp / f"{name}.h5"
    if done.returncode or not path.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"{name}: exit code {done.returncode}\n{tail}")
    return read_mean_jct(path, args.requests)


def run_study(args: argparse.Namespace, tmp: Path) -> tuple[list, dict, list[str]]:
    """Every (cell, deployment) in turn with a progress line: (gains[k][i][j], the mean JCTs
    per deployment in the same shape, the failed cells' names)."""
    cells = grid(args.prompts, args.ratios, args.rps)
    shape = (len(args.rps), len(args.prompts), len(args.ratios))
    jcts = {side.name: _nan_cells(shape) for side in DEPLOYMENTS}
    gains, failed = _nan_cells(shape), []
    num_runs, started = len(cells) * len(DEPLOYMENTS), time.monotonic()
    for n, (cell, side) in enumerate((c, s) for c in cells for s in DEPLOYMENTS):
        k, i, j = cell.rps_idx, cell.prompt_idx, cell.ratio_idx
        try:
            jcts[side.name][k][i][j] = run_side(args, cell, side, tmp)
        except (RuntimeError, ValueError, OSError) as exc:
            print(f"heatmap: run failed, cell {cell.name} is NaN: {exc}", flush=True)
            failed.append(f"{cell.name} ({side.name})")
        elapsed = time.monotonic() - started
        eta = elapsed / (n + 1) * (num_runs - n - 1)
        jct = jcts[side.name][k][i][j]
        print(
            f"heatmap: run {n + 1}/{num_runs} {cell.name} {side.name}: mean JCT {jct:.3f} s "
            f"(virtual); {elapsed:.0f} s elapsed, ETA {eta:.0f} s",
            flush=True,
        )
        if side is DEPLOYMENTS[-1]:
            gains[k][i][j] = gain(jcts[COLOCATED.name][k][i][j], jcts[PD.name][k][i][j])
    return gains, jcts, failed


def _nan_cells(shape: tuple[int, int, int]) -> list:
    return [[[math.nan] * shape[2] for _ in range(shape[1])] for _ in range(shape[0])]


def plot(heatmap: Heatmap, prompts: list[int], ratios: list[float], path: Path) -> None:
    """One panel per rate plus the combined map: a diverging colour map centred on 0 (red: the
    PD pair faster), each cell's value printed (NaN: a failed run)."""
    # here: matplotlib, a measured start-up cost of every command
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"{s:g} requests/s", rate) for s, rate in zip(heatmap.rps, heatmap.cells)]
    panels.append(("combined (sum over the rates)", heatmap.combined))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.9), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels):
        finite = [abs(v) for row in values for v in row if math.isfinite(v)]
        limit = max(finite, default=1.0) or 1.0
        ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, origin="lower")
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                ax.text(
                    j,
                    i,
                    f"{v:+.2f}" if math.isfinite(v) else "NaN",
                    ha="center",
                    va="center",
                    fontsize=9,
                )
        ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
        ax.set_yticks(range(len(prompts)), [str(p) for p in prompts])
        ax.set_xlabel("decode / prompt")
        ax.set_title(title, fontsize=10)
    axes[0][0].set_ylabel("prompt tokens")
    fig.suptitle("JCT(colocated) / JCT(PD) - 1, virtual 910C clock (> 0: PD faster)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def cmd_heatmap(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid(args.prompts, args.ratios, args.rps)  # refuses a bad axis before any run
    with tempfile.TemporaryDirectory(prefix="xds-heatmap-") as tmp:
        gains, jcts, failed = run_study(args, Path(tmp))
    meta = {
        "source": "xds-mpi heatmap (docs/heatmap.md), virtual 910C clock",
        "cell": "mean JCT(colocated) / mean JCT(pd) - 1 over the batch, JCT = finish - arrival",
        "pd": f"configs/pd.yaml with {', '.join(PD.sets)}",
        "colocated": f"configs/colocated.yaml with {', '.join(COLOCATED.sets)}",
        "num_requests": args.requests,
        "chunk_tokens": args.chunk_tokens,
        "seed": args.seed,
        "sets": list(args.set),
        "jct_s": jcts,
        "failed": failed,
    }
    heatmap = build_heatmap(args.prompts, args.ratios, args.rps, gains, meta)
    write_heatmap(out / "heatmap.json", heatmap)
    plot(heatmap, args.prompts, args.ratios, out / "heatmap.png")
    print(f"heatmap: {out / 'heatmap.json'}, {out / 'heatmap.png'}")
    for name in failed:
        print(f"heatmap: failed: {name}")
    print(
        f"sign-stable cells across the rates: {heatmap.sign_stable_share:.0%} "
        f"(DeepServe §5.3.1: over {DEEPSERVE_SIGN_STABLE:.0%})"
    )
    return 1 if failed else 0


def _numbers(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "heatmap",
        help="PD vs colocated JCT heatmap (DeepServe Figure 6) on the virtual clock",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--prompts", type=_numbers(int), default=[128, 512, 1024], help="tokens")
    p.add_argument("--ratios", type=_numbers(float), default=[0.0625, 0.25, 1.0])
    p.add_argument("--rps", type=_numbers(float), default=[1.0, 4.0, 16.0], help="requests/s")
    p.add_argument("--requests", type=int, default=16, help="identical requests per run")
    p.add_argument(
        "--chunk-tokens", type=int, default=1024, help="rows per die and iteration (both sides)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload.seed (the prompts' tokens)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="passed to every run, after the study's own",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it is killed")
    p.add_argument("--out", default="heatmap", help="directory for heatmap.json and heatmap.png")
    p.set_defaults(func=cmd_heatmap)
