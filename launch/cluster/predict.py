"""`xds-mpi predict`: the JE's decode-length model (DeepServe §5.3.3; docs/decode_length.md)
trained on the first part of a trace by time and measured on the rest, beside the
majority-class baseline and DeepServe's 84.9 %; writes the model file `cluster.predictor` names."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from launch.report.tables import format_table
from xds_mpi.cluster.length_model import (
    NUM_CLASSES,
    TOP_BUCKET,
    Evaluation,
    evaluate,
    split_by_time,
    train,
)
from xds_mpi.cluster.predict import BUCKET_TOKENS
from xds_mpi.config.schema import ConfigError
from xds_mpi.config.trace import TraceConfig
from xds_mpi.workload.requests import Request
from xds_mpi.workload.trace_replay import TraceLine, read_trace

DEEPSERVE_ACCURACY = 0.849  # DeepServe §5.3.3: an LLM classifier reading the prompt's text


def add_parser(sub) -> None:
    p = sub.add_parser(
        "predict",
        help="train and measure the JE's decode-length model on a trace",
        description="Train the decode-length classifier (128-token buckets, numpy) on the "
        "first --train-share of a trace's requests by arrival, measure it on the rest, print "
        "its accuracy beside the majority class and DeepServe's 84.9 %%, and write the model "
        "file (use it with --set cluster.predictor=FILE).",
    )
    p.add_argument("--trace", required=True, metavar="FILE", help="the trace (Mooncake JSONL)")
    p.add_argument("--format", choices=("mooncake", "azure"), default="mooncake")
    p.add_argument(
        "--train-share", type=float, default=0.5, help="share trained on, by time (default 0.5)"
    )
    p.add_argument("--out", default="length_model.json", metavar="FILE", help="model to write")
    p.add_argument(
        "--known-after-s",
        type=float,
        default=60.0,
        help="seconds after its arrival from which a request's output length counts as "
        "known to later requests (default 60)",
    )
    p.add_argument("--min-leaf", type=int, default=40, help="rows per leaf at least (default 40)")
    p.add_argument(
        "--block-tokens", type=int, default=512, help="trace tokens per hash id (default 512)"
    )
    p.set_defaults(func=cmd_predict)


def trace_lines_as_requests(lines: list[TraceLine]) -> list[Request]:
    """The lines as the JE sees them at the trace's own times and lengths (speedup 1)."""
    start_s = min((line.timestamp_s for line in lines), default=0.0)
    return [
        Request(
            req_id=k,
            prompt=(),
            max_new_tokens=line.output_len,
            arrival_s=line.timestamp_s - start_s,
            trace_prompt_len=line.input_len,
            trace_output_len=line.output_len,
            trace_line=line.line_no,
            block_ids=line.hash_ids,
        )
        for k, line in enumerate(lines)
    ]


def _part(name: str, part: list[Request]) -> str:
    return (
        f"{name}: {len(part)} requests, trace lines {part[0].trace_line}..{part[-1].trace_line}, "
        f"arrivals {part[0].arrival_s:.1f}..{part[-1].arrival_s:.1f} s"
    )


def format_evaluation(e: Evaluation) -> str:
    """The accuracies, then one row per bucket that occurs."""
    low = e.majority_class * BUCKET_TOKENS
    lines = [
        f"accuracy on the {e.num_eval} held-out requests: {e.accuracy:.1%} "
        f"(DeepServe §5.3.3: {DEEPSERVE_ACCURACY:.1%}, an LLM reading the prompt's text)",
        f"majority-class baseline (bucket {e.majority_class}, {low}..{low + BUCKET_TOKENS - 1} "
        f"tokens, the training part's most frequent): {e.majority_accuracy:.1%}",
        f"within +-1 bucket: {e.within_one:.1%}",
    ]
    rows = []
    for c in range(NUM_CLASSES):
        if e.true_counts[c] or e.predicted_counts[c]:
            low = c * BUCKET_TOKENS
            tokens = f">= {low}" if c == TOP_BUCKET else f"{low}..{low + BUCKET_TOKENS - 1}"
            right = e.correct_counts[c] / e.true_counts[c] if e.true_counts[c] else 0.0
            rows.append(
                [
                    str(c),
                    tokens,
                    str(e.true_counts[c]),
                    str(e.predicted_counts[c]),
                    f"{e.correct_counts[c]} ({right:.0%})",
                ]
            )
    headers = ["bucket", "output tokens", "true", "predicted", "right (recall)"]
    return "\n".join([*lines, format_table(headers, rows)])


def cmd_predict(args: argparse.Namespace) -> int:
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started:5.1f} s] {line}", flush=True)

    t = TraceConfig(path=args.trace, format=args.format, block_tokens=args.block_tokens)
    read = read_trace(t)
    lines = [x for x in read if isinstance(x, TraceLine)]
    if len(lines) < 2:
        raise ConfigError(f"--trace {args.trace}: {len(lines)} usable lines, at least 2 needed")
    progress(f"{args.trace}: {len(lines)} requests ({len(read) - len(lines)} bad lines skipped)")
    try:
        train_part, held_out = split_by_time(trace_lines_as_requests(lines), args.train_share)
    except ValueError as exc:
        raise ConfigError(f"--train-share: {exc}") from None
    progress(_part("train", train_part))
    progress(_part("evaluate", held_out))
    model = train(
        train_part,
        block_tokens=args.block_tokens,
        known_after_s=args.known_after_s,
        min_leaf=args.min_leaf,
        progress=progress,
    )
    model.meta.update(
        trace=Path(args.trace).name,
        train_lines=[train_part[0].trace_line, train_part[-1].trace_line],
    )
    progress(f"trained: depth {model.meta['max_depth']}, {len(model.tree.feature)} nodes")
    result = evaluate(model, train_part, held_out)
    model.meta["eval_accuracy"] = round(result.accuracy, 4)
    print(format_evaluation(result))
    model.save(args.out)
    print(f"wrote {args.out} (use it: --set cluster.predictor={args.out})")
    return 0
