"""Replaying a production request trace (`workload.source: trace`, docs/trace.md).

Two formats: Mooncake's JSONL (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`:
one id per `trace.block_tokens`-token block of the prompt, equal ids = equal blocks) and Azure's
CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`). A window of the trace becomes requests that
arrive at the trace's times / `speedup`, with lengths x `length_scale` (the tiny model serves
tens of tokens, not the trace's thousands); each request keeps the trace's own lengths for the
projection. Prompt tokens are made per hash id, seeded by (`workload.seed`, id), so equal ids
give equal token blocks: a shared prefix in the trace is a shared prefix served.

A line that cannot be served (blank, not JSON or CSV, a field missing or of the wrong type,
a negative or decreasing timestamp, hash ids that do not cover the prompt, served lengths over
the model's length or a die's KV) becomes a request with a problem naming the line and the
reason: rejected, the others served.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from xds_mpi.config.schema import Config, ConfigError, TraceConfig
from xds_mpi.workload.requests import Request

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class BadLine(ValueError):
    """A trace line that cannot become a request; the message is the reason."""


@dataclass(frozen=True, kw_only=True)
class TraceLine:
    """One line of a trace as read: timestamp in seconds, lengths in trace tokens, block ids
    (Mooncake; () for Azure, whose prompts share nothing)."""

    line_no: int
    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def _count(item: dict, key: str) -> int:
    if key not in item:
        raise BadLine(f"field {key!r} missing")
    value = item[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadLine(f"{key} must be an integer, got {value!r}")
    if value < 1:
        raise BadLine(f"{key}({value}) must be >= 1")
    return value


def parse_mooncake(text: str, line_no: int, block_tokens: int) -> TraceLine:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise BadLine(f"not a JSON object: {text.strip()[:40]!r}")
    if "timestamp" not in item:
        raise BadLine("field 'timestamp' missing")
    stamp = item["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise BadLine(f"timestamp must be a number of ms, got {stamp!r}")
    input_len, output_len = _count(item, "input_length"), _count(item, "output_length")
    if "hash_ids" not in item:
        raise BadLine("field 'hash_ids' missing")
    ids = item["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise BadLine(f"hash_ids must be a list of integers, got {str(ids)[:40]}")
    num_blocks = math.ceil(input_len / block_tokens)
    if len(ids) != num_blocks:
        raise BadLine(
            f"{len(ids)} hash_ids for input_length({input_len}): ceil({input_len} / "
            f"trace.block_tokens({block_tokens})) = {num_blocks} expected"
        )
    return TraceLine(
        line_no=line_no,
        timestamp_s=stamp / 1e3,
        input_len=input_len,
        output_len=output_len,
        hash_ids=tuple(ids),
    )


def _azure_seconds(text: str) -> float:
    """Seconds, or a date-time such as Splitwise's 2023-11-16 18:15:46.6805900 (seconds since
    the epoch; only differences matter)."""
    try:
        return float(text)
    except ValueError:
        pass
    head, dot, frac = text.partition(".")
    try:
        return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if dot else 0.0)
    except ValueError:
        raise BadLine(f"TIMESTAMP {text!r} is neither seconds nor a date-time") from None


def parse_azure(text: str, line_no: int) -> TraceLine:
    fields = [f.strip() for f in text.split(",")]
    if len(fields) != 3:
        raise BadLine(f"{len(fields)} fields, 3 expected ({','.join(AZURE_HEADER)})")
    counts = []
    for name, field in zip(AZURE_HEADER[1:], fields[1:]):
        try:
            value = int(field)
        except ValueError:
            raise BadLine(f"{name} must be an integer, got {field!r}") from None
        counts.append(_count({name: value}, name))
    return TraceLine(
        line_no=line_no,
        timestamp_s=_azure_seconds(fields[0]),
        input_len=counts[0],
        output_len=counts[1],
    )


def read_trace(t: TraceConfig) -> list[TraceLine | BadLine]:
    """The window's lines, in file order: a TraceLine, or a BadLine (message: "line N: why").

    The window opens at the first line `start_s` trace seconds after the first request and
    closes `duration_s` later or after `max_requests` lines; a bad line inside it counts as one
    of its lines. A timestamp below an earlier one is bad (the trace is in arrival order)."""
    path = Path(t.path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"trace.path {str(path)!r}: {exc.strerror}") from None
    out: list[TraceLine | BadLine] = []
    first_s, latest_s = None, -math.inf
    for line_no, text in enumerate(lines, start=1):
        if t.format == "azure" and line_no == 1 and text.startswith(AZURE_HEADER[0]):
            continue
        try:
            if not text.strip():
                raise BadLine("blank line")
            line = (
                parse_azure(text, line_no)
                if t.format == "azure"
                else parse_mooncake(text, line_no, t.block_tokens)
            )
            if line.timestamp_s < 0:
                raise BadLine(f"negative timestamp {line.timestamp_s:g} s")
            if line.timestamp_s < latest_s:
                raise BadLine(
                    f"timestamp {line.timestamp_s:g} s before the line above's {latest_s:g} s"
                )
        except BadLine as exc:
            if t.start_s == 0 or (first_s is not None and latest_s - first_s >= t.start_s):
                out.append(BadLine(f"{path.name} line {line_no}: {exc}"))
        else:
            latest_s = line.timestamp_s
            first_s = line.timestamp_s if first_s is None else first_s
            since = line.timestamp_s - first_s
            if since < t.start_s:
                continue
            if t.duration_s and since >= t.start_s + t.duration_s:
                break
            out.append(line)
        if t.max_requests and len(out) >= t.max_requests:
            break
    return out


def trace_requests(cfg: Config) -> list[Request]:
    """The window's lines as requests (the bad ones with their problem), ids in line order."""
    t, w = cfg.trace, cfg.workload
    if not t.path:
        raise ConfigError("trace.path must name a trace file when workload.source is trace")
    lines = read_trace(t)
    start_s = min((x.timestamp_s for x in lines if isinstance(x, TraceLine)), default=0.0)
    blocks = BlockTokens(seed=w.seed, vocab_size=cfg.model.vocab_size, t=t)
    requests = []
    for req_id, line in enumerate(lines):
        if isinstance(line, BadLine):
            requests.append(Request(req_id=req_id, prompt=(), max_new_tokens=0, problem=str(line)))
            continue
        prompt = blocks.prompt(line, max(1, round(line.input_len * t.length_scale)))
        output_len = max(1, round(line.output_len * t.output_factor))
        problem = _over_cap(cfg, len(prompt), output_len)
        requests.append(
            Request(
                req_id=req_id,
                prompt=prompt,
                max_new_tokens=output_len,
                arrival_s=(line.timestamp_s - start_s) / t.speedup,
                problem=f"{Path(t.path).name} line {line.line_no}: {problem}" if problem else "",
                trace_prompt_len=line.input_len,
                trace_output_len=line.output_len,
                trace_line=line.line_no,
                block_ids=line.hash_ids,
            )
        )
    return requests


def _over_cap(cfg: Config, prompt_len: int, output_len: int) -> str:
    """Why the served lengths do not fit the model or a die's KV ("" when they do)."""
    depth, sched = cfg.scheduler.mtp_depth, cfg.scheduler
    total = prompt_len + output_len + depth
    named = f"served prompt({prompt_len}) + output({output_len}) + mtp_depth({depth}) = {total}"
    if total > cfg.model.max_seq_len:
        return f"{named} > model.max_seq_len({cfg.model.max_seq_len})"
    capacity = sched.num_kv_blocks_per_die * sched.kv_block_tokens
    if total > capacity:
        return f"{named} > a die's KV capacity ({capacity} tokens)"
    return ""


class BlockTokens:
    """Served tokens per trace block: the block of hash id h is the same `served_block_tokens`
    tokens wherever h appears, drawn from a generator seeded by (seed, h); Azure lines, which
    carry no ids, draw their whole prompt from (seed, -line)."""

    def __init__(self, *, seed: int, vocab_size: int, t: TraceConfig) -> None:
        self.seed, self.vocab_size = seed, vocab_size
        self.block = t.served_block_tokens
        self.cache: dict[int, np.ndarray] = {}

    def _tokens(self, key: int, num: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, key & 0xFFFFFFFF, key >> 32 & 0xFFFFFFFF])
        return rng.integers(0, self.vocab_size, num)

    def of(self, hash_id: int) -> np.ndarray:
        if hash_id not in self.cache:
            self.cache[hash_id] = self._tokens(hash_id, self.block)
        return self.cache[hash_id]

    def prompt(self, line: TraceLine, num_tokens: int) -> tuple[int, ...]:
        if not line.hash_ids:
            return tuple(int(x) for x in self._tokens(-line.line_no, num_tokens))
        # [num_tokens]: the blocks in order, the last one cut
        tokens = np.concatenate([self.of(h) for h in line.hash_ids])[:num_tokens]
        return tuple(int(x) for x in tokens)


@dataclass(frozen=True, kw_only=True)
class PrefixHits:
    """How much of each prompt an unbounded prefix cache would hold when the prompt arrives:
    its leading blocks whose whole id chain (this block and every one before it) came in an
    earlier request; at least the prompt's last token is always computed."""

    num_blocks: int
    num_hit_blocks: int
    prompt_tokens: int
    hit_tokens: int

    @property
    def reuse(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def hit_blocks(requests: list[Request]) -> dict[int, int]:
    """req_id -> how many leading blocks of its prompt an unbounded prefix cache holds when it
    arrives (`requests` taken in arrival order)."""
    seen: set[int] = set()
    hits: dict[int, int] = {}
    for req in sorted(requests, key=lambda r: (r.arrival_s, r.req_id)):
        key, num, is_hit = 0, 0, True
        for block_id in req.block_ids:
            key = hash((key, block_id))  # the chain: this block and its whole prefix
            if is_hit and key in seen:
                num += 1
            else:
                is_hit = False
                seen.add(key)
        hits[req.req_id] = num
    return hits


def cached_tokens(req: Request, num_hit_blocks: int, block_tokens: int) -> int:
    """The prompt tokens (trace lengths) of its hit blocks; at least the last one is computed."""
    return min(num_hit_blocks * block_tokens, req.priced_prompt_len - 1)


def cached_prefixes(cfg: Config, records: dict) -> dict[int, int]:
    """req_id -> cached prompt tokens (trace lengths) of each served request of a run."""
    served = [r.req for r in records.values() if not r.rejected]
    hits = hit_blocks(served)
    return {r.req_id: cached_tokens(r, hits[r.req_id], cfg.trace.block_tokens) for r in served}


def prefix_hits(requests: list[Request], block_tokens: int) -> PrefixHits:
    """Over `requests` in arrival order (trace lengths, block ids)."""
    hits = hit_blocks(requests)
    return PrefixHits(
        num_blocks=sum(len(r.block_ids) for r in requests),
        num_hit_blocks=sum(hits.values()),
        prompt_tokens=sum(r.priced_prompt_len for r in requests),
        hit_tokens=sum(cached_tokens(r, hits[r.req_id], block_tokens) for r in requests),
    )


def trace_summary(cfg: Config, records: dict) -> dict:
    """The replay's numbers: window lines, rejected ones, tokens at the trace's lengths and as
    served, and the prefix reuse of the served requests."""
    served = [r.req for r in records.values() if not r.rejected]
    hits = prefix_hits(served, cfg.trace.block_tokens)
    return {
        "trace_lines": len(records),
        "trace_rejected": len(records) - len(served),
        "trace_prompt_tokens": sum(r.trace_prompt_len for r in served),
        "trace_output_tokens": sum(r.trace_output_len for r in served),
        "served_prompt_tokens": sum(len(r.prompt) for r in served),
        "served_output_tokens": sum(r.max_new_tokens for r in served),
        "trace_blocks": hits.num_blocks,
        "trace_prefix_hit_blocks": hits.num_hit_blocks,
        "trace_prefix_reuse": hits.reuse,
    }


def format_trace(s: dict) -> str:
    return (
        f"trace: {s['trace_lines']} lines in the window, {s['trace_rejected']} rejected; "
        f"prompt tokens {s['trace_prompt_tokens']} in the trace, {s['served_prompt_tokens']} "
        f"served; output tokens {s['trace_output_tokens']} in the trace, at most "
        f"{s['served_output_tokens']} served; prefix reuse {s['trace_prefix_reuse']:.1%} "
        f"({s['trace_prefix_hit_blocks']}/{s['trace_blocks']} blocks already seen)"
    )
