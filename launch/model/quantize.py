"""`xds-mpi quantize`: an INT8 checkpoint from a trained one (xDeepServe §4.7), and with --eval
the accuracy ablation float / RTN / +smoothing / +GPTQ / +smoothing+GPTQ on held-out text.
Reads the stdlib corpus through xds_mpi/train/corpus.py (torch); the dies never run this."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from xds_mpi.config.schema import ConfigError
from xds_mpi.model.checkpoint import read_quant_info, weights_path
from xds_mpi.model.params import LazyParams
from xds_mpi.model.qlinear import SCALE_SUFFIX, SMOOTH_SUFFIX, base_name
from xds_mpi.model.tokenizer import BOS_ID, EOS_ID
from xds_mpi.model.transformer import DeepSeekModel
from xds_mpi.model.weights import load_model, read_weights
from xds_mpi.quant.calibrate import calibrate
from xds_mpi.quant.quantize import METHODS, QuantOptions, quantize_state, save_quantized
from xds_mpi.quant.text import corpus_streams, spread_windows

ABLATION = ("rtn", "smooth", "gptq", "smooth+gptq")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="INT8 post-training quantization of a checkpoint (SmoothQuant + GPTQ)",
        description="Calibrate on the checkpoint's training text (the stdlib files not held "
        "out), smooth each MLA / MLP / expert projection's input (SmoothQuant), quantize its "
        "weights per output channel (GPTQ or round-to-nearest) and write an INT8 checkpoint "
        "that runs with --set model.weights=FILE. --eval prints the accuracy ablation on the "
        "held-out files.",
    )
    p.add_argument("--weights", default="tiny", help="float checkpoint (default: tiny)")
    p.add_argument("--out", default="tiny_int8.h5", metavar="FILE", help="INT8 checkpoint to write")
    p.add_argument("--method", choices=METHODS, default="smooth+gptq")
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant alpha (default 0.5)")
    p.add_argument(
        "--min-tokens-per-expert",
        type=int,
        default=128,
        help="calibration grows until every routed expert saw this many rows (default 128)",
    )
    p.add_argument(
        "--max-calib-windows", type=int, default=256, help="calibration cap (default 256)"
    )
    p.add_argument("--window", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument(
        "--calib-text",
        nargs="*",
        default=None,
        metavar="FILE",
        help="calibrate on these text files instead of the stdlib training files",
    )
    p.add_argument("--seed", type=int, default=0, help="calibration window seed")
    p.add_argument(
        "--max-files", type=int, default=None, help="read the first N stdlib files (quick trials)"
    )
    p.add_argument("--eval", action="store_true", help="print the accuracy ablation table")
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows (default 16)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts (default 8)")
    p.add_argument(
        "--eval-new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)"
    )
    p.set_defaults(func=cmd_quantize)


def check_args(args: argparse.Namespace, cfg) -> None:
    """Refuse what cannot work before reading any text (every number in the message)."""
    for flag in ("min_tokens_per_expert", "max_calib_windows", "window", "eval_windows"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0.0 <= args.alpha <= 1.0:
        raise ConfigError(f"--alpha must lie in [0, 1], got {args.alpha}")
    source = weights_path(args.weights)
    if read_quant_info(source) is not None:
        raise ConfigError(
            f"--weights {source} is already an INT8 checkpoint: quantize its float one"
        )
    if Path(args.out).resolve() == source.resolve():
        raise ConfigError(f"--out {args.out} would overwrite the float checkpoint it reads")
    # Even perfectly balanced routing gives each expert windows x window x top_k / experts rows.
    best = args.max_calib_windows * args.window * cfg.top_k // cfg.num_routed_experts
    if best < args.min_tokens_per_expert:
        raise ConfigError(
            f"--min-tokens-per-expert({args.min_tokens_per_expert}) cannot be reached: "
            f"--max-calib-windows({args.max_calib_windows}) x --window({args.window}) x "
            f"top_k({cfg.top_k}) / num_routed_experts({cfg.num_routed_experts}) = {best} rows "
            "per expert at best"
        )
    if args.window + 1 > cfg.max_seq_len:
        raise ConfigError(f"--window({args.window}) exceeds model.max_seq_len({cfg.max_seq_len})")
    for path in args.calib_text or []:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--calib-text {path!r} does not exist")


def _calibration_stream(args: argparse.Namespace):
    if args.calib_text:
        ids = [t for p in args.calib_text for t in (BOS_ID, *Path(p).read_bytes(), EOS_ID)]
        return np.array(ids, np.int64), None
    return corpus_streams(max_files=args.max_files)


def cmd_quantize(args: argparse.Namespace) -> int:
    cfg, state = read_weights(weights_path(args.weights))
    check_args(args, cfg)
    start = time.perf_counter()
    train, heldout = _calibration_stream(args)
    cal = calibrate(
        load_model(weights_path(args.weights)),
        train,
        window_len=args.window,
        batch_windows=8,
        min_tokens_per_expert=args.min_tokens_per_expert,
        max_windows=args.max_calib_windows,
        seed=args.seed,
    )
    print(describe_calibration(cal), flush=True)
    out, info = quantize_state(state, cal, QuantOptions(method=args.method, alpha=args.alpha))
    save_quantized(cfg, out, info, args.out)
    print(describe_bytes(info, out))
    print(
        f"xds-mpi: wrote {args.out} ({args.method}, alpha {args.alpha}) in "
        f"{time.perf_counter() - start:.1f} s; serve it with --set model.weights={args.out}"
    )
    if args.eval:
        if heldout is None:
            heldout = corpus_streams(max_files=args.max_files)[1]
        print(ablation(args, cfg, state, cal, heldout))
    return 0


def describe_calibration(cal) -> str:
    counts = [n for c in cal.expert_tokens.values() for n in c]
    short = cal.short_experts
    lines = [
        f"xds-mpi: calibrated on {cal.num_windows} training windows x {cal.window_len} tokens "
        f"= {cal.num_windows * cal.window_len:,} tokens; rows per routed expert "
        f"min {min(counts, default=0)}, max {max(counts, default=0)} "
        f"(minimum asked {cal.min_tokens_per_expert})"
    ]
    if short:
        listed = ", ".join(f"{e.rstrip('.')} ({n})" for e, n in short.items())
        lines.append(
            f"xds-mpi: {len(short)} experts stayed under {cal.min_tokens_per_expert} rows and are "
            f"rounded to nearest without smoothing: {listed}"
        )
    return "\n".join(lines)


def describe_bytes(info: dict, out: dict) -> str:
    num_params = sum(out[n].size for n in info["projections"])
    extra = sum(
        out[k].size * 4
        for n in info["projections"]
        for k in (base_name(n) + SCALE_SUFFIX, base_name(n) + SMOOTH_SUFFIX)
        if k in out
    )
    mib = 1 << 20
    return (
        f"xds-mpi: {len(info['projections'])} projections, {num_params:,} weights: "
        f"{num_params * 2 / mib:.2f} MiB as BF16 -> {(num_params + extra) / mib:.2f} MiB as INT8 "
        f"+ float32 scales"
    )


def ablation(args, cfg, state, cal, heldout) -> str:
    # here: a measured start-up cost of every command
    from xds_mpi.quant.evaluate import evaluate, format_table

    def model_of(tensors):
        return DeepSeekModel(cfg, LazyParams.of_arrays(tensors, np.float64))

    models, weight_errors = {"float": (model_of(state), False)}, []
    for method in ABLATION:
        tensors, info = quantize_state(state, cal, QuantOptions(method=method, alpha=args.alpha))
        models[method] = (model_of(tensors), False)
        weight_errors.append(f"{method} {info['weight_error_mean']:.3e}")
    models["smooth+gptq+kv"] = (models["smooth+gptq"][0], True)  # and the INT8 latent cache
    windows = spread_windows(heldout, num_windows=args.eval_windows, window_len=args.window)
    prompt_windows = spread_windows(heldout[1:], num_windows=args.eval_prompts, window_len=32)
    rows = evaluate(
        models,
        windows,
        [list(w) for w in prompt_windows.tolist()],
        reference="float",
        new_tokens=args.eval_new_tokens,
    )
    return (
        f"Held out: {args.eval_windows} windows x {args.window} tokens (teacher-forced), "
        f"{args.eval_prompts} prompts x 32 tokens + {args.eval_new_tokens} generated (MTP 1)\n"
        + format_table(rows)
        + "\nWeight rounding error per projection (mean trace(D H D^T) / trace(W H W^T), "
        "calibration H): " + ", ".join(weight_errors)
    )
