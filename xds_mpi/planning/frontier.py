"""Goodput, the SLO, and the Pareto frontier of the priced candidates."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from xds_mpi.config.schema import ConfigError
from xds_mpi.planning.queue import Served


@dataclass(frozen=True, kw_only=True)
class Slo:
    ttft_s: float
    tpot_s: float

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'ttft=2s,tpot=35ms' (units s or ms; both keys needed)."""
        values = {}
        for part in filter(None, text.split(",")):
            match = re.fullmatch(r"\s*(ttft|tpot)\s*=\s*([0-9.]+)\s*(ms|s)\s*", part)
            if not match:
                raise ConfigError(
                    f"--slo: {part!r} is not ttft=<n>s|ms or tpot=<n>s|ms "
                    "(e.g. --slo ttft=2s,tpot=35ms)"
                )
            key, number, unit = match.groups()
            values[key] = float(number) * (1e-3 if unit == "ms" else 1.0)
        if set(values) != {"ttft", "tpot"} or min(values.values()) <= 0:
            raise ConfigError(f"--slo needs ttft and tpot, both > 0; got {text!r}")
        return cls(ttft_s=values["ttft"], tpot_s=values["tpot"])

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s, TPOT <= {self.tpot_s * 1e3:g} ms"


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A candidate's replay, summed: goodput (requests meeting the SLO per second of the window,
    per chip), output tokens/s per chip (over the window or until the last finish, the longer),
    the 99th percentiles, and the share meeting the SLO."""

    goodput_per_chip: float
    tokens_per_s_per_chip: float
    ttft_p99_s: float
    tpot_p99_s: float
    met_fraction: float
    chips: float

    def miss(self, slo: Slo) -> float:
        """How far the p99s are above the SLO: the larger of p99 / SLO, less 1 (<= 0: met)."""
        return max(self.ttft_p99_s / slo.ttft_s, self.tpot_p99_s / slo.tpot_s) - 1.0


def meets(served: Served, slo: Slo) -> np.ndarray:
    """[n] bool: each request within both limits (a one-token output has no TPOT and meets it;
    a request never served, TTFT NaN, does not)."""
    tpot_ok = np.isnan(served.tpot_s) | (served.tpot_s <= slo.tpot_s)
    return (served.ttft_s <= slo.ttft_s) & tpot_ok


def outcome(
    served: Served, *, output_len: np.ndarray, duration_s: float, chips: float, slo: Slo
) -> Outcome:
    met = meets(served, slo)
    span = max(duration_s, float(np.nanmax(served.finish_s)))
    tpots = served.tpot_s[~np.isnan(served.tpot_s)]
    return Outcome(
        goodput_per_chip=met.sum() / duration_s / chips,
        tokens_per_s_per_chip=output_len.sum() / span / chips,
        ttft_p99_s=float(np.quantile(served.ttft_s, 0.99)),
        tpot_p99_s=float(np.quantile(tpots, 0.99)) if len(tpots) else 0.0,
        met_fraction=float(met.mean()),
        chips=chips,
    )


def pareto(points: list[tuple[float, float, float]]) -> list[int]:
    """Indices of the points no other point dominates, for (tokens/s per chip: higher is
    better, TPOT p99: lower, TTFT p99: lower); of equal points the first is kept."""
    pts = np.asarray(points, float).reshape(-1, 3)  # [n, 3]
    tok, tpot, ttft = pts.T
    order = np.arange(len(pts))
    keep = []
    for i in range(len(pts)):
        as_good = (tok >= tok[i]) & (tpot <= tpot[i]) & (ttft <= ttft[i])
        better = (tok > tok[i]) | (tpot < tpot[i]) | (ttft < ttft[i])
        dominates = as_good & (better | (order < i))
        dominates[i] = False
        if not dominates.any():
            keep.append(i)
    return keep
