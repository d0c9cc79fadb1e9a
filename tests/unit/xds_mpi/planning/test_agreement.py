"""The planned-vs-emulated distribution measure on a hand-made pair of samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from xds_mpi.planning.agreement import agreement
from xds_mpi.planning.frontier import Slo
from xds_mpi.planning.queue import Served

SLO = Slo(ttft_s=1.0, tpot_s=0.050)


def served(ttft, tpot) -> Served:
    ttft, tpot = np.array(ttft, float), np.array(tpot, float)
    return Served(first_s=ttft, finish_s=ttft + 1.0, ttft_s=ttft, tpot_s=tpot)


def test_percentile_errors_and_flips_of_a_hand_made_pair():
    # five requests; the plan's TTFTs are the run's x 1.1, its TPOTs the run's - 5 ms
    emulated = served([0.2, 0.4, 0.6, 0.8, 0.95], [0.030, 0.040, 0.052, 0.060, np.nan])
    planned = served([0.22, 0.44, 0.66, 0.88, 1.045], [0.025, 0.035, 0.047, 0.055, np.nan])
    a = agreement(planned, emulated, SLO)
    # TTFT: every quantile scales by 1.1 (p50 0.66 / 0.6, p99 by linear interpolation)
    assert a.ttft_p50.error == pytest.approx(0.10)
    assert a.ttft_p99.error == pytest.approx(0.10)
    # TPOT over the 4 with one: p50 (0.041 / 0.046), p99 at 0.97 of the last gap
    assert (a.tpot_p50.planned, a.tpot_p50.emulated) == (pytest.approx(0.041), pytest.approx(0.046))
    assert a.tpot_p50.error == pytest.approx(0.041 / 0.046 - 1)
    p99_e, p99_p = 0.052 + 0.97 * 0.008, 0.047 + 0.97 * 0.008
    assert a.tpot_p99.error == pytest.approx(p99_p / p99_e - 1)
    # verdicts: request 2 (TPOT 52 -> 47 ms) met in the plan only; request 4 (TTFT 0.95 ->
    # 1.045 s) in the run only; request 3 (60 / 55 ms) missed in both
    assert (a.num_flips, a.num_requests) == (2, 5)
    assert a.flip_share == pytest.approx(0.4)
    assert not a.is_met  # 40 % flipped


def test_the_same_samples_agree_and_an_empty_tpot_is_nan():
    run = served([0.2, 0.4], [np.nan, np.nan])  # one-token outputs: no TPOT
    a = agreement(run, run, SLO)
    assert a.ttft_p50.error == 0.0 and a.num_flips == 0
    assert math.isnan(a.tpot_p99.error)
    assert a.is_met


def test_a_zero_emulated_tpot_is_no_division():
    # two-token outputs with MTP: both tokens in one step, TPOT 0
    run = served([0.2, 0.4], [0.0, 0.0])
    assert agreement(run, run, SLO).tpot_p50.error == 0.0
    a = agreement(served([0.2, 0.4], [0.01, 0.01]), run, SLO)
    assert a.tpot_p50.error == math.inf and not a.is_met
