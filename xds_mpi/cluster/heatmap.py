"""The heatmap of PD-disaggregated against PD-colocated TEs (DeepServe's Figure 6;
docs/heatmap.md): for a grid of prompt length x decode/prompt ratio x request rate, the JCT of
identical requests on a colocated TE over their JCT on a disaggregated pair of the same dies,
minus one (positive: the pair is faster). `combined` sums the cells over the rates: the map
`pd_heatmap` reads. A JSON file: plain data a user can read and plot without the project.

Lengths are the ones the dies' virtual clock prices: the served lengths (the study serves its
trace at `trace.length_scale` 1, so they equal `priced_prompt_len` and `priced_output_len`; a
scaled-down replay's `priced_*` are the trace's lengths, which that clock does not price, see
docs/heatmap.md). A cell covers prompts in [prompt_edges[i], prompt_edges[i + 1]) and
decode/prompt ratios in [ratio_edges[j], ratio_edges[j + 1]); a length outside the grid takes
the nearest edge cell.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Heatmap:
    """prompt_edges: P + 1 prompt lengths; ratio_edges: R + 1 decode/prompt ratios; rps: the
    request rates studied; cells[k][i][j]: JCT(colocated) / JCT(pd) - 1 at rps[k], prompt cell
    i, ratio cell j (NaN where a run failed); combined[i][j]: the sum over the rates;
    sign_stable_share: the share of cells whose sign is the same at every rate; meta: how it
    was made (configs, dies, seed, ...)."""

    prompt_edges: tuple[float, ...]
    ratio_edges: tuple[float, ...]
    rps: tuple[float, ...]
    cells: tuple[tuple[tuple[float, ...], ...], ...]
    combined: tuple[tuple[float, ...], ...]
    sign_stable_share: float
    meta: dict = field(default_factory=dict)

    def cell_of(self, prompt_len: float, decode_len: float) -> tuple[int, int]:
        """(prompt cell, ratio cell) of a request of these lengths."""
        i = _cell(self.prompt_edges, prompt_len)
        j = _cell(self.ratio_edges, decode_len / max(prompt_len, 1))
        return i, j

    def value(self, prompt_len: float, decode_len: float) -> float:
        """The combined map's value for a request of these lengths (> 0: the PD pair)."""
        i, j = self.cell_of(prompt_len, decode_len)
        return self.combined[i][j]


def _cell(edges: tuple[float, ...], x: float) -> int:
    return min(max(bisect.bisect_right(edges, x) - 1, 0), len(edges) - 2)


def write_heatmap(path: str | Path, heatmap: Heatmap) -> None:
    Path(path).write_text(json.dumps(asdict(heatmap), indent=1, allow_nan=True) + "\n")


def read_heatmap(path: str | Path) -> Heatmap:
    """The heatmap in `path`; ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
        heatmap = Heatmap(
            prompt_edges=tuple(data["prompt_edges"]),
            ratio_edges=tuple(data["ratio_edges"]),
            rps=tuple(data["rps"]),
            cells=tuple(tuple(tuple(row) for row in rate) for rate in data["cells"]),
            combined=tuple(tuple(row) for row in data["combined"]),
            sign_stable_share=float(data["sign_stable_share"]),
            meta=dict(data.get("meta", {})),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"heatmap {path}: not a heatmap file ({exc})") from exc
    shape = (len(heatmap.prompt_edges) - 1, len(heatmap.ratio_edges) - 1)
    rows = [heatmap.combined, *heatmap.cells]
    if min(shape) < 1 or any((len(r), *{len(c) for c in r}) != shape for r in rows):
        raise ValueError(f"heatmap {path}: cells are not {shape[0]} x {shape[1]}")
    return heatmap
