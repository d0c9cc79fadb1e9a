"""Issue 61 item 5: the colocated two-stream die's core split. A profile with die.stream_split
equal (ascend910c_kernels) prices two streams at the share of the cube cores that equalises
them; the default (whole cores) keeps the best whole-core split, or the one a scenario states.
Each layer is recomputed from the two streams the model prices at that split."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import REPO_ROOT

from xds_mpi.config.hardware import load_profile, stream_split
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.topology import Topology
from xds_mpi.projection import bands
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.imbalance import Imbalance
from xds_mpi.projection.layers import (
    LayerInputs,
    _streams,
    colocated_layer,
    counts,
    equalising_split,
    split_streams,
)
from xds_mpi.projection.paper_data import SCENARIOS, VALIDATION
from xds_mpi.projection.paper_table import _inputs as _paper_inputs
from xds_mpi.projection.project import project

BIG = cost_shape()
KERNELS = "ascend910c_kernels"


def _inputs(profile: str, *, batch: int = 48, stream0_aic: float | None = None) -> LayerInputs:
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml", [])
    hw = Hardware.from_profile(load_profile(profile))
    return LayerInputs(
        cfg=cfg, cost=CostModel(BIG, hw), n=counts(cfg, Topology.from_config(cfg)), batch=batch,
        kv_len=4096, rows_per_seq=2, imbalance=Imbalance(), microbatches=2,
        stream0_aic=stream0_aic,
    )  # fmt: skip


def test_the_profiles_choose_their_split():
    assert Hardware.from_profile(load_profile(KERNELS)).equal_streams
    assert not Hardware.from_profile(load_profile("ascend910c")).equal_streams
    with pytest.raises(ConfigError, match="'halves'"):
        stream_split({"stream_split": "halves"})


@pytest.mark.parametrize("batch", [32, 48, 64])
def test_the_equalising_split_gives_two_equal_streams_and_a_layer_of_twice_one(batch):
    x = _inputs(KERNELS, batch=batch)
    a = equalising_split(x)
    _, stream0, stream1 = _streams(x, *split_streams(x.cost, a))
    assert stream0 == pytest.approx(stream1, rel=1e-3)
    _, prim, details = colocated_layer(x)
    assert details["stream 0 AIC"] == a
    assert prim["layer"] == 2 * max(stream0, stream1)
    # a stream given more cores gets shorter, the other longer (the bisection's premise)
    _, s0_more, s1_less = _streams(x, *split_streams(x.cost, a + 1))
    assert s0_more < stream0 and s1_less > stream1


@pytest.mark.parametrize("batch", [32, 48, 64])
def test_equalising_is_never_slower_than_any_whole_core_split(batch):
    """Direction: the whole-core splits are points the continuous search could land on, so the
    equalised layer is at most the best of them, and below it unless a whole split already
    equalises."""
    x = _inputs(KERNELS, batch=batch)
    equal = colocated_layer(x)[1]["layer"]
    whole = colocated_layer(
        replace(x, cost=CostModel(BIG, replace(x.cost.hw, equal_streams=False)))
    )
    assert equal <= whole[1]["layer"] * (1 + 1e-6)
    for aic in range(8, 21):
        _, s0, s1 = _streams(x, *split_streams(x.cost, aic))
        assert equal <= 2 * max(s0, s1) * (1 + 1e-6)


def test_a_given_split_is_kept_on_either_profile():
    for profile in ("ascend910c", KERNELS):
        x = _inputs(profile, stream0_aic=16)
        _, prim, details = colocated_layer(x)
        _, s0, s1 = _streams(x, *split_streams(x.cost, 16))
        assert details["stream 0 AIC"] == 16 and prim["layer"] == 2 * max(s0, s1)


def test_the_stated_16_8_is_the_split_bands_other_end_at_b96():
    """[001] §4.2.3's stream 0 row: the point at the equalising split, the band's other end at
    the stated 16 AIC (recomputed: stream 0 on 16 of 24 AIC)."""
    pub = next(p for p in VALIDATION if p.metric == "stream 0")
    s = SCENARIOS[pub.scenario]
    assert s.stream0_aic == 16
    (inp,) = [i for i in bands.band_inputs() if i.name.startswith("two-stream split")]
    point, stated = (bands.row_value(pub, s, v) for v in inp.variants)
    cfg, m, hw, kwargs = _paper_inputs(s, KERNELS)
    at16 = replace(kwargs["execution"], stream0_aic=16)
    whole = replace(hw, equal_streams=False)
    assert (
        stated
        == project(cfg, m, whole, **{**kwargs, "execution": at16}).primitives_s["stream 0"] * 1e6
    )
    assert point != stated
    band = bands.row_band(pub)
    assert band.swings[inp.name] == (min(point, stated), max(point, stated))
    assert band.holds(band.point)
    # one-stream scenarios have no split to vary
    assert not inp.applies(SCENARIOS["001 b24 4096+256"])
