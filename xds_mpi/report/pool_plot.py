"""The report's pool figure (docs/cluster.md "A pool of ranks"): a row per pool rank on the
virtual clock, a bar per turn in its TE's colour, from the scale-out that took the rank until the
decision that gave it back: light while its TE scales out (the decision until it serves), solid
while it serves, hatched while it drains, an x at its TE's loss (the rank then out of the pool
for good); each scale event's decision a dotted line across."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from xds_mpi.report.data import RunData  # noqa: E402

DPI = 80


@dataclass(frozen=True, kw_only=True)
class PoolSpan:
    """Pool rank `rank`'s turn as rank `die` of TE `te`, virtual seconds: taken at the scale-out
    decided at `taken_s`, serving from `serves_s`, drained from `drained_s` (its end when not
    drained), back in the pool at `end_s` (the run's last finish when never given back; its
    TE's loss when `is_lost`)."""

    rank: int
    te: int
    die: int
    taken_s: float
    serves_s: float
    drained_s: float
    end_s: float
    is_lost: bool = False


def pool_spans(c: dict) -> list[PoolSpan]:
    """Each /cluster/pool row beside its TE's scale events (c: `cluster_data`)."""
    pool, scaling = c.get("pool", {}), c.get("scaling", {})
    events = list(
        zip(
            scaling.get("kind", ()),
            scaling.get("te", ()),
            scaling.get("decided_s", ()),
            scaling.get("serves_s", ()),
            strict=True,
        )
    )
    out = []
    lost = pool.get("lost_s", np.full(len(pool.get("te", ())), np.nan))  # older files: none
    for te, rank, die, taken_s, given_back_s, lost_s in zip(
        *(pool.get(k, ()) for k in ("te", "rank", "die", "taken_s", "given_back_s")),
        lost,
        strict=True,
    ):
        end_s = given_back_s if np.isfinite(given_back_s) else max(c["end_s"], taken_s)
        end_s = lost_s if np.isfinite(lost_s) else end_s
        serves_s = next(
            (s for k, t, d, s in events if k == "out" and t == te and d == taken_s), taken_s
        )
        drained_s = next(
            (d for k, t, d, _ in events if k == "in" and t == te and taken_s < d <= end_s), end_s
        )
        out.append(
            PoolSpan(
                rank=int(rank),
                te=int(te),
                die=int(die),
                taken_s=float(taken_s),
                serves_s=float(min(serves_s, end_s)),
                drained_s=float(drained_s),
                end_s=float(end_s),
                is_lost=bool(np.isfinite(lost_s)),
            )
        )
    return out


def pool(run: RunData, path: Path) -> Path:
    """The pool's ranks over virtual time, a row each (see the module's docstring)."""
    c = run.cluster
    spans = pool_spans(c) if c else []
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.5 * len({s.rank for s in spans})))
    if not spans:
        ax.text(0.5, 0.5, "no pool of ranks (cluster.pool: 0)", ha="center", va="center")
        ax.set_xticks([])
        ax.set_yticks([])
        return _save(fig, path)
    ranks = sorted({s.rank for s in spans})
    row = {rank: i for i, rank in enumerate(ranks)}
    colors = plt.get_cmap("tab10")
    for s in spans:
        y, color = row[s.rank], colors(s.te % 10)
        ax.barh(y, s.serves_s - s.taken_s, left=s.taken_s, color=color, alpha=0.35)
        ax.barh(y, s.drained_s - s.serves_s, left=s.serves_s, color=color)
        ax.barh(y, s.end_s - s.drained_s, left=s.drained_s, color=color, alpha=0.6, hatch="//")
        ax.text(s.serves_s, y, f" TE {s.te} die {s.die}", va="center", fontsize=7)
        if s.is_lost:
            ax.plot([s.end_s], [y], "kx", ms=10)
    scaling = c["scaling"]
    for kind, te, decided_s in zip(scaling["kind"], scaling["te"], scaling["decided_s"]):
        ax.axvline(decided_s, color="tab:green" if kind == "out" else "tab:orange", ls=":")
        ax.text(decided_s, 1.01, f"{kind} {te}", fontsize=7, transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(ranks)), [f"pool rank {rank}" for rank in ranks])
    ax.set_ylim(-0.5, len(ranks) - 0.5)
    ax.set_xlim(0, max(c["end_s"], max(s.end_s for s in spans)))
    ax.set_xlabel("virtual s")
    ax.set_title(
        f"{run.name}: the pool's ranks (light: scaling out, solid: serving, hatched: draining, "
        "x: lost; dotted: scale events, green out, orange in)",
        fontsize=8,
        pad=14,
    )
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
