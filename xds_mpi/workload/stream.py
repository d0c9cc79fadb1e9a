"""The request stream: a seeded synthetic generator, a JSONL file of prompts, or a window of a
production trace (xds_mpi/workload/trace_replay.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xds_mpi.config.schema import Config, ConfigError, WorkloadConfig
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.workload.requests import Request

NUM_BYTES = 256  # synthetic prompts are byte tokens


def load_workload(cfg: Config) -> list[Request]:
    w = cfg.workload
    if w.source == "trace":
        # start-up: every rank builds the plan, only the TE-shell reads a trace (docs/design.md)
        from xds_mpi.workload.trace_replay import trace_requests

        return trace_requests(cfg)
    return jsonl_requests(w) if w.source == "jsonl" else synthetic_requests(w)


def _lengths(w: WorkloadConfig, rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    if w.length_dist == "fixed":
        return np.full(w.num_requests, lo)
    if w.length_dist == "uniform":
        return rng.integers(lo, hi + 1, w.num_requests)
    # long_tail: most requests short, a few near the maximum (Pareto, shape 1.5)
    return np.minimum(hi, lo + (rng.pareto(1.5, w.num_requests) * lo / 4).astype(int))


def synthetic_requests(w: WorkloadConfig) -> list[Request]:
    rng = np.random.default_rng(w.seed)
    prompt_lens = _lengths(w, rng, w.prompt_len, w.max_prompt_len)
    output_lens = _lengths(w, rng, w.output_len, w.max_output_len)
    if w.arrival == "rate":
        arrivals = np.cumsum(rng.exponential(1.0 / w.rate_per_s, w.num_requests))
    else:
        arrivals = np.zeros(w.num_requests)
    return [
        Request(
            req_id=i,
            prompt=tuple(int(t) for t in rng.integers(0, NUM_BYTES, n)),
            max_new_tokens=int(m),
            arrival_s=float(a),
        )
        for i, (n, m, a) in enumerate(zip(prompt_lens, output_lens, arrivals))
    ]


def jsonl_requests(w: WorkloadConfig) -> list[Request]:
    """One JSON object per line: {"prompt": text} or {"prompt_ids": [ids]}, optional
    "max_tokens" (default workload.output_len) and "arrival_s". A line that cannot be read
    becomes a request with a problem, rejected with that reason; the others are served."""
    path = Path(w.path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"workload.path {str(path)!r}: {exc.strerror}") from None
    tokenizer, requests = ByteTokenizer(), []
    for line_no, line in enumerate((ln for ln in lines if ln.strip()), start=1):
        req_id = len(requests)
        try:
            item = json.loads(line)
            prompt = (
                tokenizer.encode(item["prompt"])
                if "prompt" in item
                else [int(t) for t in item["prompt_ids"]]
            )
            requests.append(
                Request(
                    req_id=req_id,
                    prompt=tuple(prompt),
                    max_new_tokens=int(item.get("max_tokens", w.output_len)),
                    arrival_s=float(item.get("arrival_s", 0.0)),
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            requests.append(
                Request(
                    req_id=req_id,
                    prompt=(),
                    max_new_tokens=0,
                    problem=f"{path.name} line {line_no}: cannot read request "
                    f"({type(exc).__name__}: {exc})",
                )
            )
    return requests
