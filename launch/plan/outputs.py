"""What `xds-mpi plan` writes: the ranked table, the frontier's plot and one runnable config
per frontier point."""

from __future__ import annotations

from pathlib import Path

import yaml

from launch.report.tables import format_table
from xds_mpi.config.paths import resolve_config
from xds_mpi.planning.candidates import Candidate
from xds_mpi.planning.costs import BASE_CONFIG
from xds_mpi.planning.frontier import Slo
from xds_mpi.planning.search import COLOCATED_CHUNK_TOKENS, Priced

HEADERS = [
    "#",
    "deployment",
    "chips",
    "goodput/s/chip",
    "met",
    "tokens/s/chip",
    "TTFT p99 s",
    "TPOT p99 ms",
]


def table(rows: list[Priced], *, ranks: list[int] | None = None) -> str:
    out = []
    for n, p in zip(ranks or range(1, len(rows) + 1), rows):
        o = p.outcome
        out.append(
            [
                str(n),
                p.candidate.label,
                f"{o.chips:g}",
                f"{o.goodput_per_chip:.4f}",
                f"{o.met_fraction:.0%}",
                f"{o.tokens_per_s_per_chip:.1f}",
                f"{o.ttft_p99_s:.2f}",
                f"{o.tpot_p99_s * 1e3:.1f}",
            ]
        )
    return format_table(HEADERS, out)


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        return text


def config_dict(c: Candidate) -> dict:
    """The candidate as a config: configs/ep288.yaml's model section (the pod's expert layout
    on the tiny model) and its own keys, section by section."""
    base = yaml.safe_load(resolve_config(BASE_CONFIG).read_text())
    out: dict = {"deployment": dict(base["deployment"]), "model": dict(base["model"])}
    for s in c.sets:
        key, value = s.split("=", 1)
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = _value(value)
    if c.prefill_dies:
        out.setdefault("xccl", {})["p2p_pairs"] = "prefill_to_decode"
    else:  # the chunk the planner priced a colocated die's prefill at
        out["scheduler"]["prefill_chunk_tokens"] = COLOCATED_CHUNK_TOKENS
    return out


def write_config(path: Path, p: Priced, slo: Slo, source: str) -> None:
    o = p.outcome
    head = (
        f"# xds-mpi plan (docs/planning.md): {p.candidate.label}, {o.chips:g} chips.\n"
        f"# Planned on {source} against {slo}: goodput {o.goodput_per_chip:.4f} requests/s per "
        f"chip ({o.met_fraction:.0%} met), {o.tokens_per_s_per_chip:.1f} tokens/s per chip,\n"
        f"# TTFT p99 {o.ttft_p99_s:.2f} s, TPOT p99 {o.tpot_p99_s * 1e3:.1f} ms. Pod scale: "
        "`xds-mpi validate` / `xds-mpi project` it, or `xds-mpi plan --verify` runs it reduced.\n"
    )
    body = yaml.safe_dump(config_dict(p.candidate), sort_keys=False)
    path.write_text(head + body)


def plot(ranked: list[Priced], frontier: list[Priced], slo: Slo, path: Path, title: str) -> None:
    """Tokens/s per chip against TPOT p99 (left) and TTFT p99 (right): every candidate grey,
    the frontier in colour by kind, the SLO as a dashed line."""
    # here: matplotlib, a measured start-up cost of every command
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"colocated": "tab:blue", "pd": "tab:orange", "afd": "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, attr, limit, unit in (
        (axes[0], "tpot_p99_s", slo.tpot_s, 1e3),
        (axes[1], "ttft_p99_s", slo.ttft_s, 1.0),
    ):
        ax.scatter(
            [getattr(p.outcome, attr) * unit for p in ranked],
            [p.outcome.tokens_per_s_per_chip for p in ranked],
            s=8,
            c="0.75",
            label="priced",
        )
        for kind, colour in colours.items():
            pts = [p for p in frontier if p.candidate.kind == kind]
            if pts:
                ax.scatter(
                    [getattr(p.outcome, attr) * unit for p in pts],
                    [p.outcome.tokens_per_s_per_chip for p in pts],
                    s=30,
                    c=colour,
                    label=f"frontier: {kind}",
                )
        ax.axvline(limit * unit, ls="--", c="k", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("TPOT p99 (ms)" if unit == 1e3 else "TTFT p99 (s)")
        ax.set_ylabel("output tokens/s per chip")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
