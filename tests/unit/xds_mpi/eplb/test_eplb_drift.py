"""The expert-load drift between EPLB time slices (xds_mpi/eplb/drift.py): the estimator takes
the window noise out, and its two constants (DRIFT_SAME_REQUESTS, DRIFT_OTHER_TRAFFIC) are what it
measures on the trained checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.eplb.drift import DRIFT_OTHER_TRAFFIC, DRIFT_SAME_REQUESTS, measure_drift, slice_drift


def _counts(shares: np.ndarray, rows_per_half: int, rng) -> np.ndarray:
    """[slices, 2, experts] multinomial counts of two halves of each slice."""
    return np.stack(
        [[rng.multinomial(rows_per_half, s / s.sum()) for _ in range(2)] for s in shares]
    )


def test_noise_alone_measures_no_drift():
    rng = np.random.default_rng(0)
    shares = np.tile(rng.uniform(1, 8, 16), (5, 1))  # the same traffic in every slice
    drift, between, noise = slice_drift(_counts(shares, 4000, rng))
    assert drift < 0.3 * between and noise > 0


def test_a_known_drift_is_recovered_through_the_noise():
    rng = np.random.default_rng(1)
    base = np.log(rng.uniform(1, 8, 64))
    shares = np.exp(base + np.cumsum(0.3 * rng.standard_normal((5, 64)), axis=0))
    drift, _, _ = slice_drift(_counts(shares, 200_000, rng))
    assert drift == pytest.approx(0.3, rel=0.2)


def test_the_published_constants_are_the_checkpoints_measure():
    torch = pytest.importorskip(
        "torch", reason="torch is the train extra: pip install -e '.[train]'"
    )
    from xds_mpi.model.weights import weights_path
    from xds_mpi.train.corpus import load_corpus
    from xds_mpi.train.torch_model import load_torch_model

    torch.set_num_threads(1)
    model = load_torch_model(weights_path("tiny"), dtype=torch.float32)
    heldout = load_corpus().heldout
    same = measure_drift(model, heldout, same_requests=True)
    other = measure_drift(model, heldout, same_requests=False)
    assert round(same.sigma, 3) == DRIFT_SAME_REQUESTS
    assert round(other.sigma, 2) == DRIFT_OTHER_TRAFFIC
