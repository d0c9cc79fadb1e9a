"""How far a plan is from its emulation over the same requests (docs/planning.md, "Verify few").

Goodput over a few requests moves in steps (one request of 16 is 6 %), so beside it a
verification compares the latency distributions, which move smoothly with the model's error:
the TTFT and TPOT p50 and p99 (planned / emulated - 1), and the share of requests whose SLO
verdict flips (met in one, missed in the other). They agree when every percentile is within
PERCENTILE_GOAL and at most FLIP_GOAL of the requests flip."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from xds_mpi.planning.frontier import Slo, meets
from xds_mpi.planning.queue import Served

PERCENTILE_GOAL = 0.10
FLIP_GOAL = 0.10


@dataclass(frozen=True, kw_only=True)
class Quantile:
    """One quantile of a latency, planned and emulated (seconds; NaN: no sample)."""

    planned: float
    emulated: float

    @property
    def error(self) -> float:
        """planned / emulated - 1 (a TPOT of 0, every token in one MTP step: 0 if both are,
        inf if only the emulated one is)."""
        if self.emulated == 0:
            return 0.0 if self.planned == 0 else math.inf
        return self.planned / self.emulated - 1.0


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """Planned against emulated over the same requests: the TTFT and TPOT p50 and p99, and
    num_flips of num_requests whose SLO verdict changed."""

    ttft_p50: Quantile
    ttft_p99: Quantile
    tpot_p50: Quantile
    tpot_p99: Quantile
    num_flips: int
    num_requests: int

    @property
    def flip_share(self) -> float:
        return self.num_flips / self.num_requests if self.num_requests else 0.0

    @property
    def is_met(self) -> bool:
        """Every quantile within PERCENTILE_GOAL (one without samples does not count) and at
        most FLIP_GOAL of the requests flipped."""
        errors = [q.error for q in (self.ttft_p50, self.ttft_p99, self.tpot_p50, self.tpot_p99)]
        within = all(np.isnan(e) or abs(e) <= PERCENTILE_GOAL for e in errors)
        return within and self.flip_share <= FLIP_GOAL


def agreement(planned: Served, emulated: Served, slo: Slo) -> Agreement:
    """planned and emulated: the same requests, in the same order."""
    return Agreement(
        ttft_p50=_quantile(planned.ttft_s, emulated.ttft_s, 0.50),
        ttft_p99=_quantile(planned.ttft_s, emulated.ttft_s, 0.99),
        tpot_p50=_quantile(planned.tpot_s, emulated.tpot_s, 0.50),
        tpot_p99=_quantile(planned.tpot_s, emulated.tpot_s, 0.99),
        num_flips=int((meets(planned, slo) != meets(emulated, slo)).sum()),
        num_requests=len(planned.ttft_s),
    )


def _quantile(planned: np.ndarray, emulated: np.ndarray, q: float) -> Quantile:
    """Quantile q of each, over its own samples (NaNs left out)."""
    return Quantile(planned=_of(planned, q), emulated=_of(emulated, q))


def _of(samples: np.ndarray, q: float) -> float:
    kept = samples[~np.isnan(samples)]
    return float(np.quantile(kept, q)) if len(kept) else float("nan")
