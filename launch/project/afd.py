"""`xds-mpi project --afd-analysis`: seed 003's budget method for attention-FFN disaggregation
(xds_mpi/projection/afd_analysis/budget.py) on a model (--shape) and a hardware profile (--profile);
with --paper the numbers 003's text states beside the method's; with --afd-run a run file's measured
quantities beside the analytic ones. docs/afd_analysis.md."""

from __future__ import annotations

import argparse

from launch.report.tables import format_table
from xds_mpi.config.schema import ConfigError

SIGMAS = (0.7, 0.75, 0.8, 0.85)  # 003 Figure 6
FIGURE6_FFN_NODES = (2, 4, 6)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("AFD budget analysis (seed 003; docs/afd_analysis.md)")
    g.add_argument(
        "--afd-analysis",
        action="store_true",
        help="HFU bound vs FFN instances for --shape on --profile (either may be 003:<name>)",
    )
    g.add_argument("--tpot-ms", type=float, default=50.0, help="TPOT target (default 50)")
    g.add_argument("--accept-len", type=float, default=1.7, help="L_accept (003 §3.2: 1.7)")
    g.add_argument("--gap-ms", type=float, default=15.0, help="t_g (003 §3.2: 15 ms)")
    g.add_argument("--max-ffn-nodes", type=int, default=32, help="N_F range 1..this")
    g.add_argument(
        "--afd-node-ranks", type=int, default=0, help="ranks per FFN node g (0: the profile's)"
    )
    g.add_argument("--afd-run", metavar="RUN.h5", help="an afd run file: measured vs analytic")
    g.add_argument("--afd-plot", metavar="FILE.png", help="write the HFU curve and Figure 6")


def print_afd(args: argparse.Namespace) -> int:
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.projection.afd_analysis import budget as ab
    from xds_mpi.projection.afd_analysis.inputs import moe_shape, platform

    if args.max_ffn_nodes < 1 or args.tpot_ms <= 0 or args.accept_len < 1 or args.gap_ms < 0:
        raise ConfigError(
            f"need --max-ffn-nodes >= 1, --tpot-ms > 0, --accept-len >= 1, --gap-ms >= 0; got "
            f"{args.max_ffn_nodes}, {args.tpot_ms:g}, {args.accept_len:g}, {args.gap_ms:g}"
        )
    model = moe_shape(args.shape)
    hw = platform(args.profile, ranks_per_node=args.afd_node_ranks)
    scenario = ab.Scenario(
        tpot_s=args.tpot_ms * 1e-3, accept_len=args.accept_len, gap_s=args.gap_ms * 1e-3
    )
    try:
        three = ab.curve(model, hw, scenario, args.max_ffn_nodes, num_bo=3)
        two = ab.curve(model, hw, scenario, args.max_ffn_nodes, num_bo=2)
    except ValueError as exc:
        raise ConfigError(f"--afd-analysis: {exc}") from None
    if args.paper:
        print_stated(scenario)
    print_curve(model, hw, scenario, three, two)
    print_penalty()
    if args.afd_run:
        print_measured(args.afd_run, model, args.afd_node_ranks)
    if args.afd_plot:
        # here: matplotlib, a measured start-up cost of every command
        from xds_mpi.report.afd_plot import plot_afd

        print(f"plot {plot_afd(args.afd_plot, model, hw, three, two)}")
    return 0


def print_curve(model, hw, scenario, three, two) -> None:
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.projection.afd_analysis.budget import dead_zone, hfu_ceiling

    link = "Superpod (one scale-up fabric)" if hw.is_superpod else (
        f"scale-out {hw.scale_out_bytes_per_s / 1e9:g} GB/s"
    )  # fmt: skip
    print(
        f"{model.name} (H {model.hidden}, M {model.moe_intermediate}, {model.num_experts} "
        f"experts, top-{model.top_k}) on {hw.name}: {hw.flops / 1e12:g} TFLOPS, "
        f"{hw.mem_bytes_per_s / 1e12:g} TB/s, {hw.mem_bytes / 1e9:g} GB, scale-up "
        f"{hw.scale_up_bytes_per_s / 1e9:g} GB/s, {link}, {hw.ranks_per_node} ranks per node"
    )
    print(
        f"Eq. 1: TPOT {scenario.tpot_s * 1e3:g} ms x L_accept {scenario.accept_len:g} - t_g "
        f"{scenario.gap_s * 1e3:g} ms over {model.num_layers} layers: t_B "
        f"{three[0].budget_s * 1e6:.1f} us (3BO), {two[0].budget_s * 1e6:.1f} us (2BO)"
    )
    zone = dead_zone(three)
    rows = [
        [
            str(p.num_ffn_nodes),
            str(p.experts_per_rank),
            f"{p.tokens:.0f}" if p.is_feasible else "-",
            f"{p.tokens_per_expert:.1f}" if p.is_feasible else "-",
            f"{p.ofu:.1%}",
            f"{p.temporal_sparsity:.1%}",
            f"{p.hfu:.1%}",
            f"{q.hfu:.1%}",
            p.bound + (" (dead zone)" if p.num_ffn_nodes in zone else ""),
        ]
        for p, q in zip(three, two, strict=True)
    ]
    headers = ["N_F", "G", "B_rank", "tok/expert", "OFU", "S_t", "HFU 3BO", "HFU 2BO", "bound"]
    print(format_table(headers, rows))
    print(
        f"HFU ceiling (Eq. 19, B_rank = B_ScaleUp, 100 % OFU): {hfu_ceiling(model, hw):.1%}; "
        + (f"dead zone: N_F {_ranges(zone)}" if zone else "no dead zone")
    )


def print_penalty() -> None:
    """003 Figure 6: AFD's discrete-scaling penalty (Eq. 13-16) against large EP's (Eq. 12) at
    the same lambda (AFD: N_A / N_F, whole attention instances)."""
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.projection.afd_analysis.budget import alpha_afd, alpha_ep

    lams = (1, 2, 3, 4, 5)
    rows = []
    for sigma in SIGMAS:
        for n_f in FIGURE6_FFN_NODES:
            cells = [
                f"{alpha_afd(lam * n_f, n_f, sigma):.3f}/{alpha_ep(lam, sigma):.3f}" for lam in lams
            ]
            rows.append([f"{sigma:g}", str(n_f), *cells])
    print("imbalance penalty alpha, AFD/EP (Eq. 13-16 / Eq. 12), lambda = N_A / N_F = t_a / t_f:")
    print(format_table(["sigma", "N_F", *(f"lambda {lam}" for lam in lams)], rows))


def print_stated(scenario) -> None:
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.projection.afd_analysis.paper import figure4_grid, large_ep_reference, stated_rows

    rows = [
        [r.source, r.quantity, f"{r.stated:g}", f"{r.computed:.4g}", f"{r.error:+.2%}",
         f"{r.tolerance:.2%}"]
        for r in stated_rows()
    ]  # fmt: skip
    print("003's stated numbers vs the method (tolerance: half the last printed digit)")
    print(format_table(["source", "quantity", "stated", "computed", "error", "tolerance"], rows))
    ref = large_ep_reference()
    print(
        f"§3.1 large EP: {ref['tokens_per_expert']} tokens per expert, intensity "
        f"{ref['intensity']} FLOPs/byte vs the H800 ridge {ref['ridge']:.0f}: roofline OFU "
        f"{ref['roofline_ofu']:.0%}; the stated ~{ref['stated_hfu']:.0%} is Figure 3's measured "
        f"GEMM efficiency (not derivable here). AFD ceiling {ref['afd_ceiling']:.1%} < "
        f"{ref['stated_hfu']:.0%}"
    )
    print(f"Figure 4's configurations (Appendix B) at TPOT {scenario.tpot_s * 1e3:g} ms:")
    rows = [
        [g["platform"], g["model"], f"{g['ceiling']:.1%}", f"{g['best_hfu']:.1%}",
         str(g["best_ffn_nodes"] or "-"), str(g["first_feasible"] or "-"),
         _ranges(g["dead_zone"]) or "-"]
        for g in figure4_grid(scenario)
    ]  # fmt: skip
    headers = ["platform", "model", "ceiling", "best HFU", "at N_F", "first N_F", "dead zone"]
    print(format_table(headers, rows))


def print_measured(path: str, model, node_ranks: int) -> None:
    # here: xds_mpi.projection, a measured start-up cost of every command
    from xds_mpi.afd.measured import compare
    from xds_mpi.projection.afd_analysis.inputs import platform
    from xds_mpi.report.runfile import read_run_file

    cfg = read_run_file(path).config
    if cfg.deployment.kind != "afd":
        raise ConfigError(f"--afd-run {path}: deployment.kind is {cfg.deployment.kind!r}, not afd")
    hw = platform(cfg.hardware.profile, ranks_per_node=1)  # the run's FFN side: single dies
    try:
        rows, m = compare(path, model, hw, cfg)
    except ValueError as exc:
        raise ConfigError(f"--afd-run: {exc}") from None
    print(
        f"measured: {path}, {cfg.deployment.num_expert_dies} expert dies as N_F, profile "
        f"{cfg.hardware.profile}, {m.num_calls} calls of main-model MoE layers, per cost-shape "
        f"layer ({model.name})"
    )
    table = [
        [r.quantity, f"{r.analytic:.4g}", f"{r.measured:.4g}", r.unit,
         f"{r.measured / r.analytic:.3g}" if r.analytic else "-", r.note]
        for r in rows
    ]  # fmt: skip
    headers = ["quantity", "analytic", "measured", "unit", "measured/analytic", "note"]
    print(format_table(headers, table))
    layers = [
        [str(x.layer), str(x.num_calls), f"{x.tokens_per_expert:.3g}", f"{x.hottest_over_mean:.2f}",
         f"{x.gemm_s * 1e6:.1f}"]
        for x in m.layers
    ]  # fmt: skip
    print("measured per MoE layer of the run (each stands for its share of the cost shape's):")
    print(format_table(["layer", "calls", "tok/expert", "hottest/mean", "t_G us"], layers))


def _ranges(values) -> str:
    """(3, 4, 5, 8) -> "3-5, 8"."""
    out, run = [], []
    for v in values:
        if run and v != run[-1] + 1:
            out.append(run)
            run = []
        run.append(v)
    if run:
        out.append(run)
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)
