"""xds_mpi/projection/normal.py gives NormalDist's quantiles, bit for bit, in all three of
AS241's regions, so the projection's straggler waits (`expected_max_z`) keep their values."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from xds_mpi.projection.cost import expected_max_z
from xds_mpi.projection.normal import normal_quantile


def probabilities() -> list[float]:
    rng = np.random.default_rng(0)
    central = rng.uniform(0.075, 0.925, 2000)
    near = np.concatenate([rng.uniform(1e-10, 0.075, 1000), rng.uniform(0.925, 1 - 1e-10, 1000)])
    far = 10.0 ** -rng.uniform(11, 300, 1000)  # sqrt(-log p) > 5: the far tail
    far_upper = 1.0 - 10.0 ** -rng.uniform(11, 15, 100)
    edges = [0.075, 0.925, 0.5, 1e-300, 1 - 2**-53, np.exp(-25.0)]
    return [float(p) for p in (*central, *near, *far, *far_upper, *edges)]


def test_the_quantile_is_normaldists_bit_for_bit():
    reference = NormalDist()
    for p in probabilities():
        assert normal_quantile(p) == reference.inv_cdf(p), p


def test_the_expected_maximum_is_blom_on_normaldist_for_every_die_count_up_to_ep288():
    for n in range(2, 1025):
        assert expected_max_z(n) == NormalDist().inv_cdf((n - 0.375) / (n + 0.25)), n
    assert expected_max_z(1) == 0.0


@pytest.mark.parametrize("p", [0.0, 1.0, -0.5, 1.5])
def test_a_probability_outside_zero_one_is_refused(p):
    with pytest.raises(ValueError, match="0.0 < p < 1.0"):
        normal_quantile(p)
