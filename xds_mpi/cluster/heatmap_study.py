"""The heatmap study's pure parts (DeepServe §5.3.1, Figure 6; docs/heatmap.md): the grid of
prompt length x decode/prompt ratio x request rate, the per-cell trace of identical requests,
the mean JCT of a run file, each cell's gain of the PD pair over the colocated TE, the
combine over the rates and the share of cells whose sign the rates keep.

`launch/cluster/heatmap.py` runs the deployments; nothing here launches or plots.

Lengths are served as they are priced: the dies' virtual clock prices the rows a die runs, so
the trace's lengths are the served ones (`trace.length_scale` 1) and a cell's prompt length is
a `priced_prompt_len` (docs/heatmap.md says why a smaller served scale would not be priced at
the trace's lengths).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from xds_mpi.cluster.heatmap import Heatmap

BLOCK_TOKENS = 512  # Mooncake's tokens per hash id (trace.block_tokens' default)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One point of the grid: prompt_len tokens, decode/prompt ratio, rps requests/s;
    prompt_idx, ratio_idx, rps_idx: its place in the grid's axes."""

    prompt_len: int
    ratio: float
    rps: float
    prompt_idx: int
    ratio_idx: int
    rps_idx: int

    @property
    def output_len(self) -> int:
        """Decode tokens of each request: prompt x ratio, at least 1."""
        return max(1, round(self.prompt_len * self.ratio))

    @property
    def name(self) -> str:
        return f"prompt{self.prompt_len}_ratio{self.ratio:g}_rps{self.rps:g}"


def grid(prompts: list[int], ratios: list[float], rates: list[float]) -> list[Cell]:
    """Every cell, rate outermost then prompt then ratio; ValueError on an empty, unsorted or
    non-positive axis (each axis must ascend: the heatmap's edges do)."""
    for axis, values in (("prompts", prompts), ("ratios", ratios), ("rps", rates)):
        if not values or min(values) <= 0 or list(values) != sorted(set(values)):
            raise ValueError(f"heatmap: --{axis} must be positive and ascending, got {values}")
    return [
        Cell(prompt_len=p, ratio=r, rps=s, prompt_idx=i, ratio_idx=j, rps_idx=k)
        for k, s in enumerate(rates)
        for i, p in enumerate(prompts)
        for j, r in enumerate(ratios)
    ]


def edges(points: list[float]) -> tuple[float, ...]:
    """Cell edges around ascending grid points, on a log scale: the geometric mean between two
    neighbours, and half a step (of the nearest neighbour's) beyond each end; one point x gets
    (x / sqrt 2, x sqrt 2)."""
    steps = [b / a for a, b in zip(points, points[1:])] or [2.0]
    inner = [math.sqrt(a * b) for a, b in zip(points, points[1:])]
    return (points[0] / math.sqrt(steps[0]), *inner, points[-1] * math.sqrt(steps[-1]))


def trace_lines(cell: Cell, num_requests: int) -> list[dict]:
    """The cell's batch as Mooncake JSONL objects: num_requests identical requests, one every
    1 / rps seconds from 0, each with hash ids of its own (no request shares a prefix)."""
    num_blocks = -(-cell.prompt_len // BLOCK_TOKENS)
    return [
        {
            "timestamp": round(1e3 * n / cell.rps, 6),
            "input_length": cell.prompt_len,
            "output_length": cell.output_len,
            "hash_ids": list(range(n * num_blocks, (n + 1) * num_blocks)),
        }
        for n in range(num_requests)
    ]


def write_trace(path: Path, cell: Cell, num_requests: int) -> None:
    lines = trace_lines(cell, num_requests)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def mean_jct(arrival_s: list[float], finish_s: list[float]) -> float:
    """The batch's mean job completion time, finish - arrival (virtual seconds)."""
    if not arrival_s or len(arrival_s) != len(finish_s):
        raise ValueError(f"mean_jct: {len(arrival_s)} arrivals for {len(finish_s)} finishes")
    return sum(f - a for a, f in zip(arrival_s, finish_s)) / len(arrival_s)


def read_mean_jct(path: Path, num_requests: int) -> float:
    """The mean JCT of a run file's /virtual (docs/virtual_time.md); ValueError when the run
    was not on the virtual clock or did not finish every request of the batch."""
    import h5py  # here: a measured start-up cost of every command (launch/cli imports this)

    with h5py.File(path, "r") as f:
        clock = f["summary"].attrs.get("serving_clock")
        if clock != "virtual" or "virtual" not in f:
            raise ValueError(f"{path}: served on the {clock} clock, not the virtual one")
        arrival, finish = f["virtual/arrival_s"][:], f["virtual/finish_s"][:]
    if len(arrival) != num_requests:
        raise ValueError(f"{path}: {len(arrival)} of the {num_requests} requests finished")
    return mean_jct(arrival.tolist(), finish.tolist())


def gain(jct_colocated: float, jct_pd: float) -> float:
    """DeepServe's cell: JCT(colocated) / JCT(PD) - 1 (positive: the PD pair is faster)."""
    return jct_colocated / jct_pd - 1.0


def combine(cells: list[list[list[float]]]) -> list[list[float]]:
    """cells[k][i][j] over the rates k -> their element-wise sum [i][j]; NaN where any rate's
    cell is NaN (a failed run leaves the sum unknown, not smaller)."""
    return [
        [sum(rate[i][j] for rate in cells) for j in range(len(cells[0][0]))]
        for i in range(len(cells[0]))
    ]


def sign_stable_share(cells: list[list[list[float]]]) -> float:
    """The share of (prompt, ratio) cells whose sign (-, 0, +) is the same at every rate, over
    the cells finite at every rate (NaN when none is)."""
    num_finite = num_stable = 0
    for i in range(len(cells[0])):
        for j in range(len(cells[0][0])):
            values = [rate[i][j] for rate in cells]
            if all(math.isfinite(v) for v in values):
                num_finite += 1
                num_stable += len({_sign(v) for v in values}) == 1
    return num_stable / num_finite if num_finite else math.nan


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def build_heatmap(
    prompts: list[int],
    ratios: list[float],
    rates: list[float],
    cells: list[list[list[float]]],
    meta: dict,
) -> Heatmap:
    """The heatmap file's content from the gains cells[k][i][j] (rate k, prompt i, ratio j)."""
    return Heatmap(
        prompt_edges=edges([float(p) for p in prompts]),
        ratio_edges=edges([float(r) for r in ratios]),
        rps=tuple(float(s) for s in rates),
        cells=tuple(tuple(tuple(row) for row in rate) for rate in cells),
        combined=tuple(tuple(row) for row in combine(cells)),
        sign_stable_share=sign_stable_share(cells),
        meta=meta,
    )
