"""The ep288 TPOT's gap to [000] §7.1 term by term (xds_mpi/projection/ep288_gap.py): the
published terms recomputed from the paper's numbers, each rung's terms adding up to its
iteration, and each mechanism's direction."""

from __future__ import annotations

import pytest

from xds_mpi.projection import ep288_gap as gap
from xds_mpi.projection.paper_table import scenario_projection


def test_the_published_terms_are_the_papers_arithmetic():
    t = gap.published_terms()
    assert t["attention"] == pytest.approx(0.218 * 93)
    assert t["calls' own time"] == pytest.approx((185 + 165) * 59 / 1e3)
    assert t["calls' waits"] == pytest.approx((234 - 185 + 312 - 165) * 59 / 1e3)
    assert sum(t.values()) == pytest.approx(95.0)  # 93 ms and the 2 ms gap
    assert gap.published_tpot_ms() == pytest.approx(95 / 1.9)


@pytest.mark.parametrize("profile", ["ascend910c", "ascend910c_kernels"])
def test_each_rungs_terms_add_up_and_the_last_is_the_papers_scenario(profile):
    steps = gap.ladder(profile)
    for s in steps:
        terms = gap.projected_terms(s.projection)
        assert sum(terms.values()) == pytest.approx(s.projection.iteration_s * 1e3)
        assert s.band_ms[0] <= s.tpot_ms + 1e-9 <= s.band_ms[1] + 2e-9
    assert steps[-1].tpot_ms == pytest.approx(
        scenario_projection(gap.SCENARIO, profile).tpot_s * 1e3
    )


def test_each_mechanisms_direction():
    """Figure 20's fastest calls are slower than Table 7's intrinsic call (the starts raise the
    calls' own time, nothing else); INT8 attention on half the layers shortens attention; the
    kernels profile's fixed costs lengthen the rest."""
    command, starts, int8 = gap.ladder("ascend910c")
    t0, t1, t2 = (gap.projected_terms(s.projection) for s in (command, starts, int8))
    assert t1["calls' own time"] > t0["calls' own time"]
    assert t1["attention"] == pytest.approx(t0["attention"])
    assert t1["the rest"] == pytest.approx(t0["the rest"])
    assert t2["attention"] < t1["attention"]
    assert starts.tpot_ms > command.tpot_ms > 0
    kernels = gap.projected_terms(gap.ladder("ascend910c_kernels")[0].projection)
    assert kernels["the rest"] > t0["the rest"]
