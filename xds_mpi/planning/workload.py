"""The traffic a plan is made for: each request's arrival and lengths, from a trace window or
synthetic (fixed lengths, Poisson or evenly spaced arrivals)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xds_mpi.config.schema import ConfigError
from xds_mpi.config.trace import TraceConfig
from xds_mpi.workload.trace_replay import BadLine, read_trace


@dataclass(frozen=True, kw_only=True)
class PlanWorkload:
    """arrival_s: [n] float64, seconds from the window's start, ascending; prompt_len,
    output_len: [n] int64 tokens (output >= 1); duration_s: the window's length (the rate's
    denominator); source: how it was made, for the table's title."""

    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    duration_s: float
    source: str

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def rate(self) -> float:
        return self.num_requests / self.duration_s

    def mean_context(self) -> int:
        """Mean prompt + output tokens: the KV a batch slot holds on average (a paged cache's
        slots share one pool, so a full batch holds about batch x this)."""
        return int(np.ceil(np.mean(self.prompt_len + self.output_len)))

    def scaled(self, *, rate_factor: float, length_scale: float = 1.0) -> PlanWorkload:
        """The same requests arriving rate_factor x as fast, their lengths x length_scale
        (at least 1 token each): what a reduced-width verification serves."""

        def scale(n: np.ndarray) -> np.ndarray:
            return np.maximum(1, np.round(n * length_scale)).astype(np.int64)

        return PlanWorkload(
            arrival_s=self.arrival_s / rate_factor,
            prompt_len=scale(self.prompt_len),
            output_len=scale(self.output_len),
            duration_s=self.duration_s / rate_factor,
            source=f"{self.source}, rate x{rate_factor:g}, lengths x{length_scale:g}",
        )


def from_trace(
    path: str, *, start_s: float, duration_s: float, speedup: float = 1.0, max_requests: int = 0
) -> PlanWorkload:
    """A window of a Mooncake trace (docs/trace.md): arrivals at (timestamp - window start) /
    speedup; bad lines are skipped (read_trace names them)."""
    if duration_s <= 0 or speedup <= 0:
        raise ConfigError(
            f"need a window: --duration > 0 and --speedup > 0, got {duration_s:g}, {speedup:g}"
        )
    t = TraceConfig(path=path, start_s=start_s, duration_s=duration_s, max_requests=max_requests)
    lines = [x for x in read_trace(t) if not isinstance(x, BadLine)]
    if not lines:
        raise ConfigError(
            f"trace {path!r}: no request between {start_s:g} s and {start_s + duration_s:g} s"
        )
    stamps = np.array([x.timestamp_s for x in lines])
    return PlanWorkload(
        arrival_s=(stamps - stamps[0]) / speedup,
        prompt_len=np.array([max(1, x.input_len) for x in lines], dtype=np.int64),
        output_len=np.array([max(1, x.output_len) for x in lines], dtype=np.int64),
        duration_s=duration_s / speedup,
        source=f"{Path(path).name} [{start_s:g} s, +{duration_s:g} s] x{speedup:g}",
    )


def synthetic(
    *,
    prompt_len: int,
    output_len: int,
    rate: float,
    duration_s: float,
    poisson: bool = True,
    seed: int = 0,
) -> PlanWorkload:
    """Fixed lengths at `rate` requests/s for duration_s: Poisson arrivals (seeded) or evenly
    spaced ones (poisson False: the i-th at i / rate)."""
    if min(prompt_len, output_len) < 1 or rate <= 0 or duration_s <= 0:
        raise ConfigError(
            f"synthetic workload needs lengths >= 1, rate > 0, duration > 0; got "
            f"{prompt_len}, {output_len}, {rate:g}, {duration_s:g}"
        )
    num = max(1, round(rate * duration_s))
    if poisson:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
        arrival = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    else:
        arrival = np.arange(num) / rate
    return PlanWorkload(
        arrival_s=arrival,
        prompt_len=np.full(num, prompt_len, dtype=np.int64),
        output_len=np.full(num, output_len, dtype=np.int64),
        duration_s=duration_s,
        source=f"synthetic {prompt_len}+{output_len} tokens at {rate:g}/s",
    )
