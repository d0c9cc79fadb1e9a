"""`xds-mpi train-tiny` and `xds-mpi stats`: a trained checkpoint for the tiny model, and what its
router and MTP module do on held-out text. Torch is imported inside the commands."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import TYPE_CHECKING

import h5py

from xds_mpi.config.schema import ConfigError
from xds_mpi.model.shapes import compute_shape
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.model.weights import save_weights, weights_path
from xds_mpi.train.options import TrainConfig

if TYPE_CHECKING:
    from xds_mpi.config.schema import ModelConfig
    from xds_mpi.train.corpus import Corpus
    from xds_mpi.train.trainer import TrainResult

TRAIN_ATTRS = ("steps", "batch_size", "seq_len", "lr", "mtp_weight", "seed")
STATS_WINDOW = 256  # tokens per held-out window
PROMPT_TOKENS = 64  # held-out prompt length for greedy MTP decoding
DECODE_TOKENS = 64


def add_parser(subparsers) -> None:
    _add_train_parser(subparsers)
    _add_stats_parser(subparsers)


def _add_train_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-tiny",
        help="train the tiny model and its MTP module on the stdlib's sources",
        description="Train the tiny compute shape (configs/model/tiny.yaml) jointly with its MTP "
        "module(s) on this Python's standard library sources (byte-level, held-out "
        "split by file), on one CPU thread, deterministic from --seed. Writes an "
        "HDF5 checkpoint; the one shipped as model.weights: tiny is "
        "xds_mpi/data/tiny.h5.",
    )
    defaults = _add_schedule_options(p)
    p.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        metavar="N",
        help=f"init and data order seed (default {defaults.seed})",
    )
    p.add_argument(
        "--max-files",
        type=int,
        default=None,
        metavar="N",
        help="train on the first N stdlib files only (quick trials; stored in the file)",
    )
    p.add_argument(
        "--out", default="tiny.h5", metavar="FILE", help="checkpoint to write (default tiny.h5)"
    )
    routing = p.add_argument_group(
        "routing",
        "the routed experts of the compute shape (default: tiny's 16 experts, top-2, 1 group). "
        "configs/ep288.yaml's routing: --experts 256 --top-k 8 --expert-groups 8 --topk-groups "
        "4 --out ep288.h5, then run ep288 --set model.weights=ep288.h5 (a ~104 MB file; "
        "about a third of tiny's speed: docs/scale.md)",
    )
    for flag, field in (
        ("--experts", "num_routed_experts"),
        ("--top-k", "top_k"),
        ("--expert-groups", "num_expert_groups"),
        ("--topk-groups", "topk_groups"),
    ):
        routing.add_argument(flag, type=int, default=None, metavar="N", help=f"model.{field}")
    p.set_defaults(func=cmd_train_tiny)


def _add_schedule_options(p: argparse.ArgumentParser) -> TrainConfig:
    """Steps, batch, window length and learning rate, defaulting to TrainConfig's; returns those
    defaults."""
    defaults = TrainConfig()
    p.add_argument(
        "--steps",
        type=int,
        metavar="N",
        default=defaults.steps,
        help=f"optimizer steps (default {defaults.steps})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        default=defaults.batch_size,
        help=f"windows per step (default {defaults.batch_size})",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        default=defaults.seq_len,
        help=f"tokens per window (default {defaults.seq_len})",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        help=f"peak AdamW learning rate (default {defaults.lr:g})",
    )
    return defaults


def _add_stats_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "stats",
        help="expert load, MTP acceptance and perplexity of a checkpoint",
        description="On held-out stdlib files: per-layer routed-expert load (hottest / mean, "
        "share of experts above the mean), MTP acceptance per module (teacher-forced,"
        " and greedy decoding with the reference generator) and perplexity.",
    )
    p.add_argument(
        "--weights", default="tiny", help="HDF5 file, or a packaged checkpoint name (default: tiny)"
    )
    p.add_argument(
        "--text",
        nargs="*",
        default=None,
        metavar="FILE",
        help="text files to measure on instead of the held-out stdlib files",
    )
    p.add_argument(
        "--windows", type=int, default=32, help=f"windows of {STATS_WINDOW} tokens (default 32)"
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=8,
        help="held-out prompts for greedy MTP decoding (default 8)",
    )
    p.set_defaults(func=cmd_stats)


def _format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes}m{secs:02d}s"


def _progress_printer(num_steps: int):
    """One line per step rewritten in place on a terminal, else a line every 5% of the steps."""
    is_tty = sys.stdout.isatty()
    every = max(1, num_steps // 20)

    def show(report) -> None:
        if not is_tty and report.step % every and report.step != num_steps:
            return
        eta = report.elapsed_s / report.step * (num_steps - report.step)
        mtp = " ".join(f"{m:.3f}" for m in report.mtp_losses)
        line = (
            f"step {report.step}/{num_steps} loss {report.loss:.3f} mtp {mtp} "
            f"{report.tokens_per_s:,.0f} tok/s ETA {_format_duration(eta)}"
        )
        end = "\n" if not is_tty or report.step == num_steps else ""
        print(("\r" if is_tty else "") + line, end=end, flush=True)

    return show


def cmd_train_tiny(args: argparse.Namespace) -> int:
    # here: these import torch, a measured start-up cost of every other command
    from xds_mpi.train.corpus import stdlib_root
    from xds_mpi.train.trainer import train_tiny

    tc = _train_config(args)
    shape = _shape(compute_shape(), args)
    corpus = _training_corpus(args)
    print(
        f"xds-mpi: training on {corpus.num_train_files} files of {stdlib_root()} "
        f"({len(corpus.train):,} tokens; {corpus.num_heldout_files} files held out, "
        f"{len(corpus.heldout):,} tokens): {tc.steps} steps x {tc.batch_size} x {tc.seq_len} "
        f"tokens, seed {tc.seed}",
        flush=True,
    )
    start = time.perf_counter()
    result = train_tiny(shape, corpus, tc, progress=_progress_printer(tc.steps))
    _write_checkpoint(args.out, tc, result, args.max_files)
    mtp = ", ".join(f"{m:.4f}" for m in result.heldout_mtp_losses)
    print(
        f"xds-mpi: trained in {_format_duration(result.wall_s)} ({result.wall_s:.1f} s, "
        f"{result.num_tokens / result.wall_s:,.0f} tok/s); final training loss "
        f"{result.final_loss:.4f}; held-out loss {result.heldout_loss:.4f} (perplexity "
        f"{math.exp(result.heldout_loss):.3f}), MTP {mtp}; "
        f"{time.perf_counter() - start:.1f} s in all; wrote {args.out}"
    )
    return 0


def _shape(shape: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """The compute shape with the routing the options give; ConfigError (before any training)
    when the model's checks refuse it."""
    routing = {
        "num_routed_experts": args.experts,
        "top_k": args.top_k,
        "num_expert_groups": args.expert_groups,
        "topk_groups": args.topk_groups,
    }
    try:
        return dataclasses.replace(shape, **{k: v for k, v in routing.items() if v is not None})
    except ValueError as exc:
        raise ConfigError(f"train-tiny: {exc}") from None


def _train_config(args: argparse.Namespace) -> TrainConfig:
    try:
        return TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lr=args.lr,
            seed=args.seed,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _training_corpus(args: argparse.Namespace) -> Corpus:
    from xds_mpi.train.corpus import load_corpus  # here: imports torch

    try:
        return load_corpus(max_files=args.max_files)
    except ValueError as exc:  # a --max-files slice without a held-out file
        raise ConfigError(str(exc)) from None


def _write_checkpoint(path: str, tc: TrainConfig, result: TrainResult, max_files: int | None):
    """The model's weights plus, as file attributes, how it was trained and how well."""
    save_weights(result.model.cfg, result.model.arrays(), path)
    with h5py.File(path, "a") as f:
        for name in TRAIN_ATTRS:
            f.attrs[f"train_{name}"] = getattr(tc, name)
        if max_files is not None:
            f.attrs["train_max_files"] = max_files
        f.attrs["train_heldout_loss"] = result.heldout_loss
        f.attrs["train_wall_s"] = result.wall_s


def describe_weights(model: ModelConfig) -> str:
    """`xds-mpi run`'s line on what the dies serve: seeded random weights (no learned expert
    skew), or a checkpoint and how `train-tiny` made it (the attributes `_write_checkpoint`
    stores)."""
    if model.weights == "random":
        return (
            f"weights: random (seed {model.seed}), untrained: the routed-expert load has no "
            "learned skew (a trained checkpoint: `xds-mpi train-tiny`, docs/scale.md)"
        )

    path = weights_path(model.weights)
    with h5py.File(path, "r") as f:
        attrs = dict(f.attrs)
    where = model.weights if str(path) == model.weights else f"{model.weights} ({path})"
    if "train_steps" not in attrs:
        return f"weights: {where}" + (", INT8" if "quant" in attrs else "")
    files = f" on {attrs['train_max_files']} files" if "train_max_files" in attrs else ""
    return (
        f"weights: {where}, trained {attrs['train_steps']} steps x {attrs['train_batch_size']} x "
        f"{attrs['train_seq_len']} tokens{files} (seed {attrs['train_seed']}), held-out loss "
        f"{attrs['train_heldout_loss']:.3f}"
    )


def cmd_stats(args: argparse.Namespace) -> int:
    if args.windows < 1 or args.prompts < 0:
        raise ConfigError(
            f"need --windows >= 1 and --prompts >= 0, got {args.windows} and {args.prompts}"
        )
    # here: torch, a measured start-up cost of every other command
    import torch

    from xds_mpi.train.corpus import spread_windows
    from xds_mpi.train.stats import text_stats
    from xds_mpi.train.torch_model import load_torch_model

    torch.set_num_threads(1)
    model = load_torch_model(weights_path(args.weights))
    stream, source = _stats_stream(args, model)
    windows = spread_windows(stream, num_windows=args.windows, window_len=STATS_WINDOW + 1)
    stats = text_stats(model, windows)
    print(f"{args.weights}: {args.windows} windows of {STATS_WINDOW} tokens from {source}")
    print(f"held-out loss {stats.loss:.4f} nats/token, perplexity {stats.perplexity:.3f}")
    print("routed-expert load (rows per expert, top_k per token):")
    for load in stats.expert_loads:
        print(
            f"  {load.layer}: hottest/mean {load.max_over_mean:.2f}, "
            f"{load.share_above_mean:.0%} of experts above the mean, counts {list(load.counts)}"
        )
    for k, rate in enumerate(stats.mtp_acceptance, start=1):
        print(f"MTP module {k} acceptance, teacher-forced: {rate:.1%}")
    _print_decode_acceptance(model, windows[: args.prompts, :PROMPT_TOKENS].tolist())
    return 0


def _stats_stream(args: argparse.Namespace, model):
    """(token stream, where it came from): the --text files, else the held-out stdlib files."""
    # here: torch, a measured start-up cost of every other command
    import torch

    from xds_mpi.train.corpus import load_corpus

    if args.text:
        tokenizer = ByteTokenizer(model.cfg.vocab_size)
        stream = torch.tensor([t for path in args.text for t in tokenizer.encode(_read(path))])
        return stream, f"{len(args.text)} file(s)"
    corpus = load_corpus()
    return corpus.heldout, f"{corpus.num_heldout_files} held-out stdlib files"


def _print_decode_acceptance(model, prompts: list[list[int]]) -> None:
    """MTP acceptance of greedy decoding at each depth, one past the modules trained."""
    from xds_mpi.train.stats import decode_acceptance  # here: imports torch

    for depth in range(1, model.cfg.num_mtp_modules + 2) if prompts else ():
        acc = decode_acceptance(model, prompts, mtp_depth=depth, max_new_tokens=DECODE_TOKENS)
        reuse = " (module 1 reused for depth 2)" if depth > model.cfg.num_mtp_modules else ""
        print(
            f"MTP depth {depth}, greedy decoding of {len(prompts)} prompts x {DECODE_TOKENS} "
            f"tokens: {acc.num_accepted}/{acc.num_drafted} drafts accepted = {acc.rate:.1%}, "
            f"{acc.num_tokens / acc.num_steps:.2f} tokens per step{reuse}"
        )


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read --text {path!r}: {exc.strerror}") from None
