"""The `trace` section: replaying a production request trace (`workload.source: trace`,
docs/trace.md).

Part of the config schema (`xds_mpi.config.schema` re-exports it). Reading the file, making the
prompts and rejecting bad lines is `xds_mpi.workload.trace_replay`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import non_negative, positive, require


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """path: the trace file. format: mooncake (JSONL: timestamp in ms, input_length,
    output_length, hash_ids: one id per block_tokens-token block of the prompt) or azure (CSV
    TIMESTAMP,ContextTokens,GeneratedTokens; TIMESTAMP in seconds or a date-time).
    start_s, duration_s: the window, in trace seconds after the trace's first request
    (duration_s 0: to the end); max_requests: at most this many lines of the window (0: all).
    speedup: trace seconds per served second (2: twice as fast).
    length_scale: served prompt tokens per trace token (the tiny model cannot serve 12k-token
    prompts); output_scale: served output tokens per trace token (default: length_scale). Each
    served length is at least 1; the projection prices the trace's own lengths.
    block_tokens: trace tokens per hash id (Mooncake: 512)."""

    path: str = ""
    format: Literal["mooncake", "azure"] = "mooncake"
    start_s: float = 0.0
    duration_s: float = 0.0
    max_requests: int = 0
    speedup: float = 1.0
    length_scale: float = 1.0
    output_scale: float = 0.0  # 0: the same as length_scale
    block_tokens: int = 512

    def __post_init__(self) -> None:
        s = "trace"
        non_negative(
            s,
            start_s=self.start_s,
            duration_s=self.duration_s,
            max_requests=self.max_requests,
            output_scale=self.output_scale,
        )
        positive(
            s, speedup=self.speedup, length_scale=self.length_scale, block_tokens=self.block_tokens
        )
        require(
            self.length_scale <= 1.0 and self.output_scale <= 1.0,
            f"trace.length_scale({self.length_scale}) and trace.output_scale"
            f"({self.output_scale}) must be <= 1: a replay serves at most the trace's lengths",
        )

    @property
    def output_factor(self) -> float:
        return self.output_scale or self.length_scale

    @property
    def served_block_tokens(self) -> int:
        """Served tokens of one hash id's block: block_tokens x length_scale, at least 1."""
        return max(1, round(self.block_tokens * self.length_scale))
