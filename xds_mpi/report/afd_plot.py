"""The AFD analysis's figure (matplotlib, headless Agg): HFU, OFU and S_t against the FFN
instance count with the dead zone shaded (003 Figure 4's curves), and the imbalance penalty of
discrete scaling against large EP's (003 Figure 6)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display
import matplotlib.pyplot as plt  # noqa: E402

from xds_mpi.projection.afd_analysis.budget import (  # noqa: E402
    FfnPoint,
    MoeShape,
    Platform,
    alpha_afd,
    alpha_ep,
    dead_zone,
    hfu_ceiling,
)

SIGMAS = (0.7, 0.8)
FFN_NODES = (2, 4, 6)


def plot_afd(
    path: str | Path, model: MoeShape, hw: Platform, three: list[FfnPoint], two: list[FfnPoint]
) -> Path:
    """Write the two panels to `path`; returns it."""
    path = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    n = [p.num_ffn_nodes for p in three]
    left.plot(n, [p.hfu for p in three], "o-", color="tab:red", label="HFU (3BO)")
    left.plot(n, [p.hfu for p in two], "s--", color="tab:purple", label="HFU (2BO)")
    left.plot(n, [p.ofu for p in three], ":", color="tab:blue", label="OFU (3BO)")
    left.plot(n, [p.temporal_sparsity for p in three], ":", color="tab:green", label="S_t (3BO)")
    left.axhline(hfu_ceiling(model, hw), color="tab:red", lw=2.5, alpha=0.4, label="Eq. 19")
    zone = dead_zone(three)
    for i, z in enumerate(zone):
        left.axvspan(z - 0.5, z + 0.5, color="grey", alpha=0.2, label="dead zone" if not i else "")
    infeasible = [p.num_ffn_nodes for p in three if not p.is_feasible]
    for i, z in enumerate(infeasible):
        label = "infeasible (HBM)" if not i else ""
        left.axvspan(z - 0.5, z + 0.5, color="black", alpha=0.08, hatch="//", label=label)
    left.set(xlabel="FFN nodes N_F", ylabel="fraction of peak", ylim=(0, 1.05),
             title=f"{model.name} on {hw.name}")  # fmt: skip
    left.legend(fontsize=8)
    lams = [1 + i / 10 for i in range(41)]
    for sigma in SIGMAS:
        right.plot(lams, [alpha_ep(lam, sigma) for lam in lams], "-", label=f"EP, sigma {sigma}")
        for n_f in FFN_NODES:
            n_a = range(n_f, 5 * n_f + 1)
            right.plot([a / n_f for a in n_a], [alpha_afd(a, n_f, sigma) for a in n_a], "--",
                       label=f"AFD N_F {n_f}, sigma {sigma}")  # fmt: skip
    right.set(xlabel="lambda (EP: t_a / t_f; AFD: N_A / N_F)", ylabel="throughput factor alpha",
              title="imbalance penalty (003 Figure 6)")  # fmt: skip
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
