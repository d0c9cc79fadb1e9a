"""The wait for the slowest die: a body and a heavy straggler tail (xDeepServe §4.4).

A die's start of a dispatch-like call is late by X = G + T: G the body, normal with the spread
fitted to [001] Table 7 (every die's start jitters a little), and T the tail: with probability
`p` the die is a straggler, late by a Pareto amount (minimum `min_s`, shape `alpha`), else 0.
§4.4 names the tail's cause (graph launch jitter at SuperPod scale, worst at the first dispatch,
"can exceed 100 ms"; core pinning, graph caching and manual GC mitigate it) and its size class,
not its distribution: the Pareto form, p, min_s and alpha are assumptions (configs/hardware/
*.yaml `stragglers`), fixed before seed 004's dispatch/combine means and maxima were compared
to them (docs/projection.md says what was looked at when).

Where the tail lands is the profile's `per` (docs/projection.md, "form 1" and "form 2"):
- per call (form 1): every die may straggle at every call. A call's wait for the average die is
  E[max of n draws of X] - E[X]; the slowest call a run sees over `calls` calls is its
  intrinsic cost plus E[max of n x calls draws of X] plus the earliest die's lead in that call
  (sigma x E[max of n normals]).
- per pass (form 2, §4.4's launch jitter "most pronounced at the first dispatch"): a die may
  straggle once per forward pass, and the pass's first dispatch absorbs it; every other call
  (and every combine) pays the body only. `launch_s` is what the pass's critical path gains,
  `launch_mean_wait_s` the average die's extra wait at that first call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from xds_mpi.projection.normal import normal_quantile


@dataclass(frozen=True, kw_only=True)
class Tail:
    """The straggler tail: probability per die per call, Pareto minimum and shape."""

    p: float
    min_s: float
    alpha: float
    per: str = "call"  # "call": any call (form 1); "pass": a pass's first dispatch (form 2)

    def __post_init__(self) -> None:
        if not (0 <= self.p < 1 and self.min_s > 0 and self.alpha > 1):
            raise ValueError(
                f"a straggler tail needs 0 <= p < 1, min > 0 and alpha > 1 (a finite mean); "
                f"got p {self.p}, min {self.min_s} s, alpha {self.alpha}"
            )
        if self.per not in ("call", "pass"):
            raise ValueError(f"a straggler tail lands per 'call' or per 'pass', not {self.per!r}")

    @property
    def mean_s(self) -> float:
        return self.p * self.min_s * self.alpha / (self.alpha - 1)


def expected_max_s(sigma_s: float, tail: Tail | None, draws: int, body_draws: int = 0) -> float:
    """E[max of `draws` starts X = G + T and `body_draws` starts G] in seconds (no tail: sigma
    x Blom's E[max z] of all the draws)."""
    if tail is None or tail.p == 0:
        return sigma_s * _max_z(draws + body_draws)
    return _expected_max(sigma_s, tail.p, tail.min_s, tail.alpha, draws, body_draws)


def wait_s(sigma_s: float, tail: Tail | None, peers: int) -> float:
    """What the average die of a call with `peers` dies waits for the last one's start (a
    per-pass tail is not paid here: launch_s)."""
    if peers <= 1:
        return 0.0
    if tail is not None and tail.per == "pass":
        tail = None
    own = tail.mean_s if tail else 0.0
    return expected_max_s(sigma_s, tail, peers) - own


def launch_s(sigma_s: float, tail: Tail | None, peers: int) -> float:
    """Form 2: what a pass's first dispatch adds to the pass, E[max of n (G + L)] - E[max of
    n G] (0 without a per-pass tail or with one die)."""
    if tail is None or tail.per != "pass" or peers <= 1:
        return 0.0
    # both terms on the same grid (Blom's body differs from the grid's by ~0.4 % at n = 288)
    body = _expected_max(sigma_s, 0.0, tail.min_s, tail.alpha, peers)
    return expected_max_s(sigma_s, tail, peers) - body


def launch_mean_wait_s(sigma_s: float, tail: Tail | None, peers: int) -> float:
    """Form 2: the average die's extra wait at the pass's first dispatch (its own launch delay,
    E[L], is not waiting): launch_s - E[L]."""
    if tail is None or tail.per != "pass" or peers <= 1:
        return 0.0
    return launch_s(sigma_s, tail, peers) - tail.mean_s


def slowest_call_wait_s(
    sigma_s: float, tail: Tail | None, peers: int, calls: int, *, passes: int = 1,
    kind: str = "dispatch", iterations: int = 1,
) -> float:  # fmt: skip
    """The longest wait over `iterations` iterations of `calls` calls of `peers` dies: the
    latest start over all of them, seen by that call's earliest die (sigma x E[max z] ahead of
    the mean). A per-pass tail lands on the `passes` first dispatches only (none on combine)."""
    lead = sigma_s * _max_z(peers)
    if tail is not None and tail.per == "pass":
        if kind != "dispatch":
            return expected_max_s(sigma_s, None, peers * calls * iterations) + lead
        tailed = peers * passes * iterations
        body = peers * (calls - passes) * iterations
        return expected_max_s(sigma_s, tail, tailed, body) + lead
    return expected_max_s(sigma_s, tail, peers * calls * iterations) + lead


@cache
def _max_z(n: int) -> float:
    return 0.0 if n <= 1 else normal_quantile((n - 0.375) / (n + 0.25))


@cache
def _expected_max(
    sigma: float, p: float, xm: float, alpha: float, n: int, n_body: int = 0
) -> float:
    """E[max of n draws of G + T and n_body draws of G] by integrating 1 - F^n Phi^n_body on a
    grid (the body's normal convolved with the tail's point mass at 0 and its Pareto part)."""
    # the grid reaches where even n draws are unlikely to pass: the tail's 1 - 1e-6 / n quantile
    top = xm * (n * p / 1e-6) ** (1 / alpha) + 10 * sigma
    # 0 is a grid point (linspace's ends are exact): the two integrals below meet there
    x = np.concatenate([np.linspace(-10 * sigma, 0.0, 201), np.linspace(0.0, 10 * sigma, 201)[1:],
                        np.geomspace(10 * sigma + xm, top, 1200)])  # fmt: skip
    # the Pareto part on a geometric grid past the top of x: its mass between grid points
    # (CDF differences) at the midpoints; what lies beyond the grid never counts as <= x
    edges = np.geomspace(xm, top * 100, 2001)
    mass = np.diff(1 - (xm / edges) ** alpha)  # [2000]
    t = np.sqrt(edges[:-1] * edges[1:])
    body = _normal_cdf(x / sigma)
    shifted = _normal_cdf((x[:, None] - t[None, :]) / sigma) @ mass
    cdf = (1 - p) * body + p * shifted
    cdf_n = cdf**n * body**n_body
    neg, pos = x <= 0, x >= 0
    return float(np.trapezoid(1 - cdf_n[pos], x[pos]) - np.trapezoid(cdf_n[neg], x[neg]))


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """Phi(z), through Abramowitz & Stegun 7.1.26's erf (error under 1.5e-7; numpy has none)."""
    x = np.abs(z) / np.sqrt(2)
    t = 1 / (1 + 0.3275911 * x)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    erf = 1 - poly * np.exp(-x * x)
    return 0.5 * (1 + np.sign(z) * erf)


def stragglers(profile: dict, *, p: float | None = None, alpha: float | None = None) -> Tail | None:
    """The profile's straggler tail (its `stragglers` section; None without one); p / alpha:
    another value than the profile's (a band's end)."""
    section = profile.get("stragglers")
    if not section:
        return None
    return Tail(
        p=section["probability"] if p is None else p,
        min_s=section["min_us"] * 1e-6,
        alpha=section["alpha"] if alpha is None else alpha,
        per=section.get("per", "call"),
    )
