"""Issue 61: the per-chip count follows the hardware profile, and the validation table's rows are
counted by row and by experiment, each recomputed here from the model; its opt-in mechanisms
(shape-aware GEMMs, per-kernel fixed costs, bands, the straggler tail) on the profiles that
choose them (ascend910c_kernels, h800; the default ascend910c takes none:
test_default_pricing.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import REPO_ROOT

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.topology import Topology
from xds_mpi.projection.cost import Hardware
from xds_mpi.projection.paper_data import EXPERIMENTS, VALIDATION, Published
from xds_mpi.projection.paper_table import Counts, validation_table
from xds_mpi.projection.project import project

BIG = cost_shape()
KERNELS = "ascend910c_kernels"  # the 910C with issue 61's mechanisms (opt-in)
WORK = dict(batch_per_die=60, kv_len=3072, mtp_depth=1, accept_rate=0.9)


@pytest.mark.parametrize("profile", ["ascend910c", KERNELS, "h800"])
def test_tokens_per_chip_count_the_profiles_dies_per_chip(profile):
    """An H800 is one die a chip, a 910C package two: tokens/s per chip is the iteration's
    tokens over the iteration over (dies / the profile's dies per chip), whatever the emulated
    pod's layout says (cfg.hardware.dies_per_chip is 2 by default)."""
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml", [])
    hw = Hardware.from_profile(load_profile(profile))
    p = project(cfg, BIG, hw, **WORK)
    topo = Topology.from_config(cfg)
    tokens = WORK["batch_per_die"] * topo.num_dp_domains * topo.dp_groups_per_domain * 1.9
    chips = topo.num_dies / hw.dies_per_chip
    assert p.tokens_per_s_per_chip == pytest.approx(tokens / p.iteration_s / chips)
    assert hw.dies_per_chip == {"ascend910c": 2, KERNELS: 2, "h800": 1}[profile]
    doubled = project(cfg, BIG, replace(hw, dies_per_chip=2 * hw.dies_per_chip), **WORK)
    assert doubled.tokens_per_s_per_chip == pytest.approx(2 * p.tokens_per_s_per_chip)


def test_rows_are_counted_by_row_and_by_experiment():
    """Every validation row names its experiment; the counts by experiment are the rows' own
    errors; the measured Figure 22b layer is a row, stream 1's restated balance, the AFD run's
    tokens/s and the dispatch+combine share (calibration and wait rows' arithmetic) are not."""
    table = validation_table()
    n = Counts.of(table)
    valid = [r for r in table if r.role == "validation"]
    assert {r.experiment for r in valid} == set(EXPERIMENTS) == set(n.by_experiment)
    for name, (rows, in10, in15) in n.by_experiment.items():
        mine = [abs(r.error) for r in valid if r.experiment == name]
        assert (rows, in10, in15) == (len(mine), sum(e <= 0.10 for e in mine),
                                      sum(e <= 0.15 for e in mine))  # fmt: skip
    assert sum(rows for rows, _, _ in n.by_experiment.values()) == n.validation
    role = {(p.source, p.metric): p.role for p in VALIDATION}
    assert role["001 Fig. 22b", "layer"] == "validation"
    assert role["001 §4.2.3", "stream 1"] == "derived"
    assert role["000 §7.1 AFD", "tokens/s/chip"] == "derived"
    assert role["000 Fig. 20", "share dispatch+combine"] == "derived"
    with pytest.raises(ValueError, match="experiment"):
        Published(source="x", scenario="x", metric="tpot", value=1.0, unit="ms")


def _costs(profile):
    hw = Hardware.from_profile(load_profile(profile))
    return hw, hw.ops


def test_smaller_m_has_lower_compute_efficiency_and_pays_more_per_flop():
    """The H800's fit (DeepGEMM's rows): compute(M) rises with M over the grouped rows, and at
    each measured shape a GEMM of 64 rows does fewer FLOPs per second than one of 128."""
    hw, ops = _costs("h800")
    points = [v for m, v in ops.compute.points if m <= 1024]
    assert points == sorted(points) and len(points) >= 3
    for n, k in ops.memory:
        per_flop = [
            (ops.fixed_s + ops.gemm_s(m=m, params=n * k, n=n, peak=hw.int8_ops,
                                      hbm=hw.hbm_bytes_per_s, weight_bytes=1)) / (2 * m * n * k)
            for m in (64, 128)
        ]  # fmt: skip
        assert per_flop[0] > per_flop[1]


def test_the_h800_fit_reproduces_the_rows_it_was_fitted_to_within_its_spread():
    """Each DeepGEMM row's measured time over the model's, recomputed: the spread the carried
    910C ratio takes with it is exactly these ratios' range, and the fixed cost is positive."""
    from xds_mpi.projection.kernels import gemm_rows, spread

    hw, ops = _costs("h800")
    rows = gemm_rows(load_profile("h800"))
    peak = load_profile("h800")["operators"]["gemm_peak_tops"] * 1e12
    ratios = [
        r.seconds / (ops.fixed_s + ops.gemm_s(m=r.m, params=r.n * r.k, n=r.n, groups=r.groups,
                                               peak=peak, hbm=hw.hbm_bytes_per_s, weight_bytes=1))
        for r in rows
    ]  # fmt: skip
    assert spread(rows, ops, peak=peak, hbm=hw.hbm_bytes_per_s) == (min(ratios), max(ratios))
    assert ops.fixed_s > 0
    small = [x for r, x in zip(rows, ratios, strict=True) if r.m <= 128]
    assert sum(small) / len(small) == pytest.approx(1.0, abs=0.05)  # least squares: unbiased


def test_the_910c_carries_the_h800s_small_m_ratio_onto_table_10():
    """At decode M the 910C's compute efficiency is Table 10's large-M utilization times the
    H800's compute(M) / compute(large M); its GEMM bandwidth Table 9's MLA bandwidth times the
    H800's GEMM / MLA ratio; its fixed cost the H800's."""
    from statistics import median

    _, h800 = _costs("h800")
    hw, ops = _costs(KERNELS)
    rows = load_profile(KERNELS)["operators"]["gemm_rows"]
    large = median(t / 752 for *_, t, _ in rows)
    for m in (64, 256, 512, 1024):
        assert ops.compute.at(m) == pytest.approx(large * h800.compute_ratio(m))
    assert ops.compute.at(256) < ops.compute.at(1024)
    assert ops.memory_default == pytest.approx(h800.memory_default * 0.841 / 0.896)
    assert ops.fixed_s == h800.fixed_s


@pytest.mark.parametrize("profile", [KERNELS, "h800"])
def test_more_kernels_pay_more_fixed_time(profile):
    """Each kernel an operation launches pays the fixed cost: one more kernel in MLAProlog adds
    exactly that, a stream on fewer cores pays the same, and a fixed cost of 0 removes it."""
    from xds_mpi.projection.cost import CostModel

    hw = Hardware.from_profile(load_profile(profile))
    more = replace(hw, kernels={**hw.kernels, "mla_prolog": hw.kernels["mla_prolog"] + 1})
    base, extra = CostModel(BIG, hw).mla_prolog(48), CostModel(BIG, more).mla_prolog(48)
    assert extra - base == pytest.approx(hw.ops.fixed_s)
    free = replace(hw, ops=hw.ops.with_fixed(0.0))
    kernels = hw.kernels["mla_prolog"] + hw.kernels["o_proj"]
    assert base - CostModel(BIG, free).mla_prolog(48) == pytest.approx(kernels * hw.ops.fixed_s)


def test_the_h800_harness_recomputes_each_row_from_the_model():
    """Each harness row is the model's: the attention side is MLAProlog + FlashMLA at 64
    requests x 2 rows, the free-overlap layer max(2 C, C + M) (the five-stage one:
    test_h800_pipeline.py), and no published time of the profile or of
    Table 4 is among the H800 profile's constants (calibration and validation kept apart)."""
    import yaml

    from xds_mpi.projection import h800_harness as h

    cost = h.h800_cost()
    rows = {r.what: r for r in h.harness_rows(at_shape=False)}
    layer = h.decode_layer(cost)
    seqs = [(4096, 2)] * 64
    assert rows["attention side"].projected == pytest.approx(
        (cost.mla_prolog(128) + cost.attention(seqs)) * 1e6
    )
    assert rows["FlashMLA"].projected == pytest.approx(cost.attention(seqs) * 1e6)
    c, comm = layer["compute"], layer["communication"]
    assert layer["free overlap"] == max(2 * c, c + comm)
    assert rows["dispatch"].projected == pytest.approx(cost.dispatch(1024, peers=128) * 1e6)
    profile = yaml.safe_load((REPO_ROOT / "configs/hardware/h800.yaml").read_text())
    # the fitted and chosen sections (the die and link sections are vendor figures: the NIC's
    # 50 GB/s is not o_proj's 50 us)
    constants = {v for name in ("xccl", "efficiency", "operators", "serving", "kernels")
                 for v in profile[name].values() if not isinstance(v, list)}  # fmt: skip
    published = {r.published for r in rows.values()}
    assert not constants & published
    # a slower HBM moves every memory-bound row: the rows come from the hardware
    slow = replace(cost.hw, hbm_bytes_per_s=cost.hw.hbm_bytes_per_s / 2)
    slower = {r.what: r.projected for r in h.harness_rows(slow, at_shape=False)}
    assert slower["o_proj GEMM"] > rows["o_proj GEMM"].projected


def test_a_rows_band_is_the_quadrature_of_its_inputs_swings():
    """Table 5's b24 TPOT: each input projected at its two ends (recomputed here), the band
    their quadrature around the point; more fixed cost per kernel and less GEMM efficiency
    give a longer TPOT; two streams apply to b24 and b8 only."""
    import math

    from xds_mpi.projection import bands
    from xds_mpi.projection.paper_data import SCENARIOS

    pub = next(p for p in VALIDATION if p.scenario == "001 b24 4096+256" and p.metric == "tpot")
    band = bands.row_band(pub)
    s = SCENARIOS[pub.scenario]
    point = bands.row_value(pub, s, lambda s, hw: (s, hw))
    assert band.point == point
    down = up = 0.0
    for inp in bands.band_inputs():
        if not inp.applies(s):
            assert inp.name not in band.swings
            continue
        values = [bands.row_value(pub, s, v) for v in inp.variants]
        assert band.swings[inp.name] == (min(values), max(values))
        down += max(0.0, point - min(values)) ** 2
        up += max(0.0, max(values) - point) ** 2
        if inp.name in ("per-kernel fixed cost", "GEMM efficiency at decode M (carried)"):
            assert values[1] > values[0] if inp.name.startswith("per-kernel") else (
                values[0] > values[1])  # fmt: skip
    assert (band.low, band.high) == (point - math.sqrt(down), point + math.sqrt(up))
    assert band.half_width == (band.high - band.low) / 2 / point
    assert "[001] b24/b8 on one stream or two" in band.swings
    assert band.holds(point) and not band.holds(band.high * 1.01)


def test_the_wait_models_expected_maximum_is_the_sampled_one():
    """E[max of n starts] integrated numerically agrees with draws of the same body + tail
    (seeded), and without a tail it is sigma x E[max of n normals]."""
    import numpy as np

    from xds_mpi.projection.cost import expected_max_z
    from xds_mpi.projection.waits import Tail, expected_max_s

    sigma, tail, n = 20e-6, Tail(p=0.02, min_s=20e-6, alpha=1.8), 288
    rng = np.random.default_rng(61)
    draws = rng.normal(0, sigma, (20000, n))
    late = rng.random((20000, n)) < tail.p
    draws += late * tail.min_s * (1 - rng.random((20000, n))) ** (-1 / tail.alpha)
    sampled = draws.max(axis=1).mean()
    assert expected_max_s(sigma, tail, n) == pytest.approx(sampled, rel=0.05)
    assert expected_max_s(sigma, None, n) == pytest.approx(sigma * expected_max_z(n))


@pytest.mark.parametrize("heavier", [dict(p=0.05), dict(alpha=1.2)])
def test_a_heavier_tail_makes_a_larger_max_over_min(heavier):
    """The slowest call over the run against the waitless one (Figure 20's max / min), as the
    table prices it (slowest_call_of; dispatch: the profile's tail lands on a pass's first
    dispatch, waits.py form 2): a more frequent or a heavier straggler tail raises it,
    and the [000] scenario pays the profile's tail while [001]'s pay the body alone; the default
    profile has no tail (its [000] scenario pays the body alone too)."""
    from xds_mpi.projection.paper_table import scenario_inputs, slowest_call_of
    from xds_mpi.projection.waits import stragglers

    cfg, m, hw, kwargs = scenario_inputs("000 colocated", KERNELS)
    assert hw.tail == stragglers(load_profile(KERNELS)) is not None
    assert scenario_inputs("001 b96 4096+256", KERNELS)[2].tail is None
    assert scenario_inputs("000 colocated")[2].tail is None

    def max_over_min(tail_hw):
        p = project(cfg, m, tail_hw, **kwargs)
        return slowest_call_of(p, cfg, m, tail_hw, kwargs, "dispatch") / (
            p.primitives_s["dispatch intrinsic"] * 1e6
        )

    heavy = replace(hw, tail=stragglers(load_profile(KERNELS), **heavier))
    assert max_over_min(heavy) > max_over_min(hw) > max_over_min(replace(hw, tail=None))
