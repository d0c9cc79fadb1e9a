"""Issue 61's band inputs the first bands left unbracketed: the LM head's precision and sharding,
and [000]'s XCCL kernel start fixed per call or per peer reached. Each is recomputed from the
cost model's formulas, its direction checked (a cheaper head, a start that shrinks with fewer
peers), and the rows it moves keep their point inside their band."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from xds_mpi.config.hardware import load_profile
from xds_mpi.model.shapes import cost_shape
from xds_mpi.projection import bands
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.projection.paper_data import SCENARIOS, VALIDATION

BIG = cost_shape()
KERNELS = "ascend910c_kernels"


def _hw(profile: str) -> Hardware:
    return Hardware.from_profile(load_profile(profile))


def test_the_flat_heads_point_is_a_bf16_roofline_over_the_whole_vocabulary():
    """Default profile: the head reads hidden x vocab BF16 weights and does 2 x rows x hidden x
    vocab FLOPs at the BF16 peak (the flat path's formula, written out)."""
    hw = _hw("ascend910c")
    rows, params = 96, BIG.hidden * BIG.vocab_size
    flops = 2.0 * rows * params / (hw.bf16_flops * hw.gemm_eff)
    reads = params * 2 / (hw.hbm_bytes_per_s * hw.mem_eff)
    assert CostModel(BIG, hw).head(rows) == max(flops, reads)


@pytest.mark.parametrize("profile", ["ascend910c", KERNELS])
def test_an_int8_sharded_head_is_the_int8_gemm_over_its_share_of_the_vocabulary(profile):
    hw = _hw(profile)
    cheap = replace(hw, head_int8=True, head_shards=hw.dies_per_chip)
    cost, rows = CostModel(BIG, cheap), 96
    v = math.ceil(BIG.vocab_size / hw.dies_per_chip)
    assert cost.head(rows) == cost.gemm(rows, BIG.hidden * v, n=v) + cost.fixed("head")
    # direction: half the bytes per weight on half the vocabulary costs less than the point
    assert cost.head(rows) < 0.6 * CostModel(BIG, hw).head(rows)


@pytest.mark.parametrize("peers", [1, 2, 160, 288])
def test_a_start_per_peer_is_the_fixed_start_times_peers_over_its_ep(peers):
    """Per peer, the start set on an EP288 call costs peers / 288 of it; the rest of the call
    (flags, pulls, bytes, the wait for the slowest starter) is unchanged."""
    hw = _hw(KERNELS)
    fixed = CostModel(BIG, hw)
    per_peer = CostModel(BIG, replace(hw, start_per_peer_at=bands.FIG20_EP))
    for kind in ("dispatch", "combine"):
        call = getattr(fixed, kind)
        start = hw.dispatch_start_s if kind == "dispatch" else hw.combine_start_s
        saved = start * (1 - peers / bands.FIG20_EP)
        assert getattr(per_peer, kind)(48, peers=peers) == pytest.approx(
            call(48, peers=peers) - saved
        )
        assert getattr(per_peer, kind)(48, peers=peers) <= call(48, peers=peers)
    # a persistent kernel pays no start either way
    assert per_peer.dispatch(48, peers=1, persistent=True) == fixed.dispatch(
        48, peers=1, persistent=True
    )


def _row(scenario: str, metric: str):
    return next(p for p in VALIDATION if (p.scenario, p.metric) == (scenario, metric))


@pytest.mark.parametrize("metric", ["A2E", "E2A"])
def test_the_a2e_rows_swing_down_with_a_start_per_peer_and_keep_their_point_inside(metric):
    """[000] §3.3's A2E / E2A: their attention-die stage reaches one or two trampolines, so a
    start per peer prices them lower than the fixed start (the point); the band holds the point
    and spans the swing."""
    pub = _row("000 afd", metric)
    s = SCENARIOS[pub.scenario]
    name = "[000] XCCL start fixed or per peer"
    (inp,) = [i for i in bands.band_inputs() if i.name == name]
    assert inp.applies(s)
    point, per_peer = (bands.row_value(pub, s, v) for v in inp.variants)
    assert per_peer < point
    band = bands.row_band(pub)
    assert band.swings[name] == (per_peer, point)
    assert band.holds(band.point) and band.low <= per_peer
    # [001]'s scenarios keep Table 7's starts, fitted across EP sizes: the input does not apply
    assert not inp.applies(SCENARIOS["001 b96 4096+256"])


def test_the_head_input_moves_a_row_down_only():
    pub = _row("001 b24 4096+256", "tpot")
    s = SCENARIOS[pub.scenario]
    (inp,) = [i for i in bands.band_inputs() if i.name == "LM head precision and sharding"]
    point, cheap = (bands.row_value(pub, s, v) for v in inp.variants)
    assert cheap < point
    band = bands.row_band(pub)
    assert band.swings[inp.name] == (cheap, point) and band.holds(band.point)
