"""The cost of one die's part in an all-to-all primitive (dispatch, combine, A2E, E2A), from its
mechanism (xDeepServe §3.3, Figure 7): a kernel start, one count/offset flag written to every
peer, one pull from every peer plus the bytes this die takes in at its own read bandwidth (the
incast), and the wait for the slowest of the peers (each die starts with its own jitter; the
barrier waits for the maximum). Growth with EP size comes from the per-peer flags and pulls (spread
over the die's AIV cores) and from the maximum of more dies' jitter.

The kernel starts and the jitter's spread are the only fitted constants; `fit_table7` fits them
to the primitive latency table (CloudMatrix-Infer Table 7), a calibration table, never to an
end-to-end number (docs/design.md, "Calibration and validation").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


def expected_max_z(n: int) -> float:
    """E[max of n standard normal draws] (Blom's approximation); 0 for a single die."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@dataclass(frozen=True, kw_only=True)
class LinkCosts:
    """What the mechanism reads from a hardware profile."""

    read_bytes_per_s: float
    write_latency_s: float
    read_latency_s: float
    aiv_cores: int
    start_s: float  # kernel start (and quantization, for dispatch): fitted
    jitter_s: float  # spread of a die's start: fitted


def exchange_s(link: LinkCosts, *, peers: int, bytes_in: float) -> float:
    """Seconds of one die's dispatch-like exchange with `peers` dies (itself included) taking in
    `bytes_in` bytes."""
    return link.start_s + per_peer_s(link, peers=peers, bytes_in=bytes_in) + wait_s(link, peers)


def per_peer_s(link: LinkCosts, *, peers: int, bytes_in: float) -> float:
    """Step 1 (flags to every peer) and Step 2 (a pull from every peer), each core serving
    peers / cores of them one after another, plus the bytes in at the read bandwidth."""
    rounds = math.ceil(peers / link.aiv_cores)
    return rounds * (link.write_latency_s + link.read_latency_s) + bytes_in / link.read_bytes_per_s


def wait_s(link: LinkCosts, peers: int) -> float:
    """The barrier waits for the slowest of `peers` dies' starts."""
    return link.jitter_s * expected_max_z(peers)


@dataclass(frozen=True, kw_only=True)
class Table7Fit:
    """Fitted constants and the table they reproduce: rows are (op, EP, published us, fit us)."""

    dispatch_start_us: float
    combine_start_us: float
    jitter_us: float
    rows: tuple[tuple[str, int, float, float], ...]


def fit_table7(
    link: LinkCosts, table: list[tuple[str, int, float]], *, tokens: int, row_bytes: dict
) -> Table7Fit:
    """Least squares (no negative constant) of published = start(op) + jitter x z(EP) +
    per-peer terms over the rows (op, EP, latency us) of a primitive table measured at `tokens`
    x top-8 rows per rank; row_bytes: op -> bytes of one row."""
    z = np.array([expected_max_z(ep) for _, ep, _ in table])
    known = np.array(
        [per_peer_s(link, peers=ep, bytes_in=tokens * 8 * row_bytes[op]) for op, ep, _ in table]
    )
    published = np.array([us * 1e-6 for _, _, us in table])
    design = np.stack(
        [
            [1.0 if op == "dispatch" else 0.0 for op, _, _ in table],
            [1.0 if op == "combine" else 0.0 for op, _, _ in table],
            z,
        ],
        axis=1,
    )
    d0, c0, jitter = _non_negative_lstsq(design, published - known)
    fitted = design @ np.array([d0, c0, jitter]) + known
    return Table7Fit(
        dispatch_start_us=d0 * 1e6,
        combine_start_us=c0 * 1e6,
        jitter_us=jitter * 1e6,
        rows=tuple((op, ep, us, f * 1e6) for (op, ep, us), f in zip(table, fitted, strict=True)),
    )


def _non_negative_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a constant that would come out negative (a
    start shorter than nothing) is held at 0 and the others refitted."""
    free = list(range(design.shape[1]))
    while True:
        coef = np.zeros(design.shape[1])
        coef[free], *_ = np.linalg.lstsq(design[:, free], target, rcond=None)
        if (coef >= 0).all():
            return coef
        free.remove(int(np.argmin(coef)))
