"""`xds-mpi project CONFIG --sweep KEY=V1,V2,...`: the projected iteration, TPOT and throughput as
one input varies, the rest as the command line gives them, printed as a table and drawn to a plot
(a "what if" without editing YAML)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from launch.report.tables import format_table
from xds_mpi.config.schema import ConfigError, load_config

SWEEP_KEYS = {
    "batch": "requests per DP group",
    "ep": "EP size (colocated: DP groups, every die hosting experts; afd: expert dies)",
    "accept": "MTP acceptance",
    "skew": "hottest expert die's load / the mean (after placement)",
    "profile": "hardware profile (configs/hardware/)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what if (launch/project/sweep.py)")
    g.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help=f"project once per value of one input; KEY is one of {', '.join(SWEEP_KEYS)}",
    )
    g.add_argument(
        "--sweep-plot", default="project_sweep.png", help="where --sweep writes its plot (PNG)"
    )


@dataclass(frozen=True)
class Sweep:
    """One input and its values, parsed and checked before any projection."""

    key: str
    values: tuple

    @classmethod
    def parse(cls, text: str) -> Sweep:
        key, sep, raw = text.partition("=")
        if not sep or key not in SWEEP_KEYS or not raw:
            raise ConfigError(
                f"--sweep takes KEY=V1,V2,... with KEY one of {sorted(SWEEP_KEYS)}; got {text!r}"
            )
        items = [v.strip() for v in raw.split(",") if v.strip()]
        if key == "profile":
            return cls(key, tuple(items))
        kind = int if key in ("batch", "ep") else float
        try:
            values = tuple(kind(v) for v in items)
        except ValueError:
            raise ConfigError(f"--sweep {key} takes {kind.__name__}s; got {raw!r}") from None
        low, high = {"batch": (1, None), "ep": (2, None), "accept": (0, 1), "skew": (1, None)}[key]
        bad = [v for v in values if v < low or (high is not None and v > high)]
        if bad:
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"--sweep {key} values must be {bound}; got {list(bad)}")
        return cls(key, values)


def run_sweep(args: argparse.Namespace, cfg_path, m, model_inputs) -> int:
    """Project each value of the sweep; print the table and write the plot."""
    sweep = Sweep.parse(args.sweep)
    rows, points = [], []
    for value in sweep.values:
        overrides = list(args.set) + _ep_override(sweep, value, load_config(cfg_path, args.set))
        cfg = load_config(cfg_path, overrides)
        p = _project_one(args, cfg, m, model_inputs, sweep, value)
        points.append((value, p))
        prim = p.primitives_s
        rows.append([
            str(value), f"{p.iteration_s * 1e3:.2f}", f"{p.tpot_s * 1e3:.2f}",
            f"{p.tokens_per_s_per_chip:.0f}", f"{prim.get('dispatch wait', 0.0) * 1e6:.1f}",
            f"{prim.get('combine wait', 0.0) * 1e6:.1f}",
        ])  # fmt: skip
    print(f"{args.config}: sweep {sweep.key} ({SWEEP_KEYS[sweep.key]})")
    gpus = sweep.key == "profile" and any(str(v).startswith("h800") for v in sweep.values)
    per_chip = "tokens/s/chip (h800: /GPU)" if gpus else "tokens/s/chip"
    header = [sweep.key, "iteration ms", "TPOT ms", per_chip, "dispatch wait us",
              "combine wait us"]  # fmt: skip
    print(format_table(header, rows))
    _plot(sweep, points, args.sweep_plot)
    print(f"plot: {args.sweep_plot}")
    return 0


def _ep_override(sweep: Sweep, value, cfg) -> list[str]:
    if sweep.key != "ep":
        return []
    if cfg.deployment.kind == "afd":
        return [f"deployment.num_expert_dies={value}"]
    return [f"deployment.dp_groups_per_domain={value}"]


def _project_one(args, cfg, m, model_inputs, sweep: Sweep, value):
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.projection.cost import Hardware
    from xds_mpi.projection.project import project

    profile = value if sweep.key == "profile" else cfg.hardware.profile
    hw = Hardware.from_profile(load_profile(profile))
    batch = value if sweep.key == "batch" else args.batch
    inputs = model_inputs(replace_args(args, batch=batch), cfg, m)
    if sweep.key == "skew":
        inputs["imbalance"] = replace(inputs["imbalance"], moe=value, source=f"skew {value:g}x")
    return project(
        cfg, m, hw, batch_per_die=batch, kv_len=args.kv_len, mtp_depth=args.mtp,
        accept_rate=value if sweep.key == "accept" else args.accept, **inputs,
    )  # fmt: skip


def replace_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _plot(sweep: Sweep, points, path) -> None:
    """TPOT and tokens/s per chip against the swept value (Agg: no display needed)."""
    # here: matplotlib, a measured start-up cost of every command
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(v) for v, _ in points]
    x = list(range(len(points))) if sweep.key == "profile" else [v for v, _ in points]
    fig, (ax_tpot, ax_tput) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_tpot.plot(x, [p.tpot_s * 1e3 for _, p in points], marker="o")
    ax_tpot.set_ylabel("TPOT (ms)")
    ax_tput.plot(x, [p.tokens_per_s_per_chip for _, p in points], marker="o")
    ax_tput.set_ylabel("tokens/s per chip")
    for ax in (ax_tpot, ax_tput):
        ax.set_xlabel(sweep.key)
        if sweep.key == "profile":
            ax.set_xticks(x, labels)
        ax.grid(alpha=0.3)
    fig.suptitle(f"projected decode iteration, sweep {sweep.key}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
