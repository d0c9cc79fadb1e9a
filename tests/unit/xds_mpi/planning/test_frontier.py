"""The Pareto frontier drops dominated points; the SLO parser refuses bad text; goodput counts
the requests meeting both limits."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.config.schema import ConfigError
from xds_mpi.planning.frontier import Slo, outcome, pareto
from xds_mpi.planning.queue import Served


def test_dominated_points_are_dropped():
    points = [
        (100.0, 0.030, 1.0),  # 0: frontier
        (90.0, 0.030, 1.0),  # 1: dominated by 0 (fewer tokens, same latencies)
        (120.0, 0.040, 1.0),  # 2: frontier (more tokens, worse TPOT)
        (80.0, 0.020, 3.0),  # 3: frontier (best TPOT)
        (80.0, 0.020, 3.0),  # 4: equal to 3: the first kept
        (70.0, 0.025, 5.0),  # 5: dominated by 3
    ]
    assert pareto(points) == [0, 2, 3]


def test_slo_parses_units_and_refuses_bad_text():
    slo = Slo.parse("ttft=2s,tpot=35ms")
    assert slo.ttft_s == 2.0 and slo.tpot_s == pytest.approx(0.035)
    with pytest.raises(ConfigError, match="ttft=<n>s"):
        Slo.parse("ttft=2h,tpot=35ms")
    with pytest.raises(ConfigError, match="needs ttft and tpot"):
        Slo.parse("ttft=2s")


def test_goodput_counts_requests_meeting_both_limits():
    served = Served(
        first_s=np.array([1.0, 1.0, 1.0, 1.0]),
        finish_s=np.array([2.0, 2.0, 2.0, 2.0]),
        ttft_s=np.array([1.0, 3.0, 1.0, 1.0]),  # the second misses TTFT
        tpot_s=np.array([0.02, 0.02, 0.05, np.nan]),  # the third misses TPOT; the 4th has none
    )
    o = outcome(
        served,
        output_len=np.array([10, 10, 10, 1]),
        duration_s=2.0,
        chips=4.0,
        slo=Slo(ttft_s=2.0, tpot_s=0.035),
    )
    assert o.met_fraction == 0.5
    assert o.goodput_per_chip == pytest.approx(2 / 2.0 / 4.0)
    assert o.tokens_per_s_per_chip == pytest.approx(31 / 2.0 / 4.0)
