"""`xds-mpi report RUN.h5 [--out DIR] [--compare OTHER.h5]`: a run's figures as PNGs and an
index.html that shows them with the summary tables, self-contained (every image inlined, no
network); with --compare two runs side by side. (launch/report/tables.py is the topology table.)"""

from __future__ import annotations

import argparse
import base64
import html
from pathlib import Path

# Checks, once the page has loaded, that every image decoded: the result goes into the page
# (#image-check) and its title, where a headless browser's --dump-dom can read it.
IMAGE_CHECK = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const decoded = images.filter((i) => i.complete && i.naturalWidth > 0).length;
  const text = `images decoded: ${decoded}/${images.length}`;
  document.getElementById("image-check").textContent = text;
  document.title = text;
});
</script>"""
STYLE = """<style>
body { font-family: sans-serif; margin: 1em; }
table { border-collapse: collapse; font-size: 12px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.runs { display: flex; gap: 1em; } .runs > div { flex: 1; } img { max-width: 100%; }
</style>"""
SUMMARY_KEYS = (
    "status",
    "num_served",
    "num_tokens",
    "wall_s",
    "tokens_per_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "projected_iteration_ms",
    "projected_tpot_ms",
    "projected_tokens_per_s_per_chip",
    "mtp_acceptance",
    "faults_injected",
    "rollbacks",
    "recomputed_iterations",
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="plots and an HTML report of a run file",
        description="Write PNG plots of RUN.h5 (and its trace, <run>.trace.json, when it sits "
        "beside it): the per-operation breakdown per iteration on the 910C clock, per-die wall "
        "and virtual time per iteration, expert load per layer and expert, TTFT and TPOT "
        "distributions, MTP acceptance per DP group, faults and recoveries on a time axis; and "
        "DIR/index.html showing them with the summary tables (self-contained, no network).",
    )
    p.add_argument("run", type=Path, metavar="RUN.h5")
    p.add_argument(
        "--out", type=Path, help="output directory (default: <run>.report beside the run file)"
    )
    p.add_argument(
        "--compare", type=Path, metavar="OTHER.h5", help="a second run, shown side by side"
    )
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    paths = [args.run] + ([args.compare] if args.compare else [])
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"no run file {path}")
    out = args.out or args.run.with_name(f"{args.run.stem}.report")
    index = write_report(paths, out)
    print(f"report: {index.resolve()}")
    return 0


def write_report(paths: list[Path], out: Path) -> Path:
    """Every figure of every run as out/<run>_<figure>.png, then out/index.html."""
    # here: matplotlib, a measured start-up cost of every command
    from xds_mpi.report.data import load_run
    from xds_mpi.report.plots import FIGURES

    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(p) for p in paths]
    figures = {
        name: [draw(run, out / f"{i}_{run.name}_{name}.png") for i, run in enumerate(runs)]
        for name, draw in FIGURES.items()
    }
    index = out / "index.html"
    index.write_text(render_html(runs, figures))
    return index


def render_html(runs: list, figures: dict[str, list[Path]]) -> str:
    title = " vs ".join(html.escape(r.name) for r in runs)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>{STYLE}",
        f"</head><body><h1>xds-mpi report: {title}</h1><p id='image-check'>images loading</p>",
        "<h2>Summary</h2>",
        summary_table(runs),
    ]
    for name, pngs in figures.items():
        parts.append(f"<h2>{html.escape(name.replace('_', ' '))}</h2><div class='runs'>")
        parts += [f"<div><img alt='{name}' src='{_inline(p)}'></div>" for p in pngs]
        parts.append("</div>")
    parts.append(IMAGE_CHECK + "</body></html>")
    return "\n".join(parts)


def summary_table(runs: list) -> str:
    """One row per summary number, one column per run."""
    head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    rows = [f"<tr><th>run</th>{head}</tr>"]
    for key in SUMMARY_KEYS:
        cells = [r.attrs.get(key, r.summary.get(key, "")) for r in runs]
        if all(c == "" for c in cells):
            continue
        text = "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in cells)
        rows.append(f"<tr><td>{key}</td>{text}</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _inline(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
