"""`xds-mpi generate`: run the single-process reference model on one prompt.

The model is the numpy one the dies serve (xds_mpi/model/); no torch.
"""

from __future__ import annotations

import argparse
import time

from xds_mpi.config.schema import ConfigError
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.shapes import load_model_preset
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.model.weights import build_model, load_model, save_weights

DTYPES = ("float64", "float32")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with the single-process reference model",
        description="Prefill the prompt, decode greedily (or with --temperature) on one process, "
        "print the continuation and tokens per second. Weights: the preset's "
        "model.weights (tiny: the trained checkpoint) unless --weights names an HDF5 "
        "file.",
    )
    p.add_argument("--prompt", required=True, help="prompt text (byte-level tokens)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="K",
        help="MTP draft tokens per step, 0-2 (default 0: plain decoding)",
    )
    p.add_argument("--weights", default=None, metavar="FILE", help="HDF5 weights file")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--model", default="tiny", help="model preset in configs/model/ (default tiny)")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument(
        "--int8",
        action="store_true",
        help="INT8 quantize-dequantize the MoE dispatch input, as the dispatch does",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument(
        "--save-weights",
        default=None,
        metavar="FILE",
        help="also write the model's weights to FILE (HDF5)",
    )
    p.set_defaults(func=cmd_generate)


def _printable(text: str) -> str:
    """Random weights emit arbitrary bytes; escape what a terminal would not show."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else ascii(ch)[1:-1] for ch in text)


def cmd_generate(args: argparse.Namespace) -> int:
    _check_options(args)

    model = _load_model(args, args.dtype)
    tokenizer = ByteTokenizer(model.cfg.vocab_size)
    start = time.perf_counter()
    generator = ReferenceGenerator(model, _generate_options(args))
    [out] = generator.generate([tokenizer.encode(args.prompt)])
    elapsed_s = time.perf_counter() - start
    print(_printable(tokenizer.decode(list(out.tokens))))
    accepted = f", MTP accepted {out.num_accepted}/{out.num_drafted} drafts" if args.mtp else ""
    print(
        f"xds-mpi: {len(out.tokens)} tokens in {elapsed_s:.3f} s "
        f"({len(out.tokens) / elapsed_s:.1f} tokens/s, {args.dtype}, "
        f"{out.num_steps} decode steps{accepted})"
    )
    return 0


def _check_options(args: argparse.Namespace) -> None:
    if not 0 <= args.mtp <= 2:
        raise ConfigError(f"--mtp must be 0, 1 or 2, got {args.mtp}")
    if args.max_new_tokens < 1 or args.temperature < 0:
        raise ConfigError(
            f"need --max-new-tokens >= 1 and --temperature >= 0, got "
            f"{args.max_new_tokens} and {args.temperature}"
        )


def _load_model(args: argparse.Namespace, dtype):
    """--weights if given, else the preset's own weights; --save-weights writes them out."""
    model = (
        load_model(args.weights, dtype=dtype)
        if args.weights
        else build_model(load_model_preset(args.model), dtype=dtype)
    )
    if args.save_weights:
        save_weights(model.cfg, model.state_dict(), args.save_weights)
    return model


def _generate_options(args: argparse.Namespace):
    return GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        mtp_depth=args.mtp,
        temperature=args.temperature,
        seed=args.seed,
        use_int8=args.int8,
        ignore_eos=args.ignore_eos,
    )
