"""INT8 post-training quantization (xds_mpi/model/qlinear.py, xds_mpi/quant/): the kernels'
round trips and exactness, SmoothQuant's formula, GPTQ against round-to-nearest, and a quantized
checkpoint written and loaded back."""

from __future__ import annotations

import re

import numpy as np
import pytest
from harness import REPO_ROOT

from xccl.quant import QMAX, quantize_int8
from xds_mpi.config.schema import ConfigError, ModelConfig, load_config
from xds_mpi.model.checkpoint import read_quant_info
from xds_mpi.model.layers import Linear
from xds_mpi.model.mla import LatentCache
from xds_mpi.model.qlinear import (
    QuantLinear,
    channel_scales,
    dequantize_weight,
    quantize_rtn,
    round_to_grid,
)
from xds_mpi.model.weights import build_model, init_state, load_model
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.quant.calibrate import calibrate
from xds_mpi.quant.gptq import gptq_quantize, output_error
from xds_mpi.quant.quantize import QuantOptions, quantize_state, save_quantized
from xds_mpi.quant.sites import forward_windows
from xds_mpi.quant.smoothing import smooth, smoothing_factors


def _correlated_inputs(rng, rows: int, features: int, mixing=None) -> np.ndarray:
    """[rows, features] activations whose channels are mixtures of a few sources (`mixing`
    [8, features], drawn when not given), with a few outlier channels: what makes a layer's
    Hessian far from diagonal."""
    mixing = rng.standard_normal((8, features)) if mixing is None else mixing
    x = rng.standard_normal((rows, 8)) @ mixing + 0.1 * rng.standard_normal((rows, features))
    x[:, :3] *= 20.0  # outlier channels
    return x


def test_weight_round_trip_is_within_half_a_step_and_stable():
    w = np.random.default_rng(0).standard_normal((48, 96))
    q, scale = quantize_rtn(w)
    assert q.dtype == np.int8 and np.abs(q).max() == QMAX  # every row's max maps to +-127
    back = dequantize_weight(q, scale)
    step = scale.astype(np.float64)[:, None]
    assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-12))
    # Quantizing the dequantized weight gives the same integers and scales again.
    q2, scale2 = quantize_rtn(back)
    assert np.array_equal(q2, q) and np.allclose(scale2, scale, rtol=1e-7)


def test_activation_round_trip_is_within_half_a_step_per_token():
    x = np.random.default_rng(1).standard_normal((9, 64)) * np.arange(1, 10)[:, None]
    q, scale = quantize_int8(x)
    back = q.astype(np.float64) * scale.astype(np.float64)[:, None]
    assert np.all(np.abs(back - x) <= scale.astype(np.float64)[:, None] / 2 * (1 + 1e-6))


def test_int8_projection_is_the_exact_int32_product_with_both_scales():
    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((40, 200)), rng.standard_normal((13, 200))
    smooth_s = rng.uniform(0.5, 2.0, 200).astype(np.float32)
    q_w, w_scale = quantize_rtn(w * smooth_s)
    y = QuantLinear(q_w, w_scale, smooth_s)(x)
    q_x, x_scale = quantize_int8(x / smooth_s.astype(np.float64))
    acc = q_x.astype(np.int64) @ q_w.astype(np.int64).T  # true integer arithmetic
    expected = acc.astype(np.float64) * x_scale.astype(np.float64)[:, None] * w_scale
    assert np.array_equal(y, expected)


def test_int8_projection_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(3)
    q_w, w_scale = quantize_rtn(rng.standard_normal((96, 128)))
    layer = QuantLinear(q_w, w_scale)
    x = rng.standard_normal((130, 128))
    full = layer(x)
    for num_rows in range(1, 131):
        assert np.array_equal(layer(x[:num_rows]), full[:num_rows]), f"{num_rows} rows"
    assert np.array_equal(layer(x[7:8]), full[7:8])


def test_smoothing_moves_range_from_activations_to_weights_as_the_formula_says():
    rng = np.random.default_rng(4)
    x = _correlated_inputs(rng, 256, 32)
    w = rng.standard_normal((24, 32))
    act_max, w_max = np.abs(x).max(0), np.abs(w).max(0)
    s = smoothing_factors(act_max, w, 0.5).astype(np.float64)
    np.testing.assert_allclose(s, np.sqrt(act_max / w_max), rtol=1e-6)
    w_s, h_s, act_s = smooth(w, x.T @ x, act_max, s)
    x_s = x / s
    # alpha = 1/2: both ranges become sqrt(max|X_j| max|W_j|), channel by channel.
    np.testing.assert_allclose(np.abs(x_s).max(0), np.sqrt(act_max * w_max), rtol=1e-6)
    np.testing.assert_allclose(np.abs(w_s).max(0), np.sqrt(act_max * w_max), rtol=1e-6)
    np.testing.assert_allclose(act_s, np.abs(x_s).max(0), rtol=1e-12)
    np.testing.assert_allclose(h_s, x_s.T @ x_s, rtol=1e-9)
    np.testing.assert_allclose(x_s @ w_s.T, x @ w.T, rtol=1e-9, atol=1e-9)  # same product
    # alpha = 1: all of the range goes to the weights, every activation channel's max is 1.
    s1 = smoothing_factors(act_max, w, 1.0).astype(np.float64)
    np.testing.assert_allclose(np.abs(x / s1).max(0), 1.0, rtol=1e-6)


def test_smoothing_lowers_the_int8_error_of_a_layer_with_outlier_channels():
    rng = np.random.default_rng(5)
    x, w = _correlated_inputs(rng, 512, 64), rng.standard_normal((32, 64))
    exact = x @ w.T

    def int8_error(s):
        q, scale = quantize_rtn(w * s)
        return np.linalg.norm(QuantLinear(q, scale, s)(x) - exact)

    s = smoothing_factors(np.abs(x).max(0), w, 0.5)
    assert int8_error(s) < int8_error(np.ones(64, np.float32))


def test_gptq_reduces_the_output_error_of_round_to_nearest():
    rng = np.random.default_rng(6)
    mixing = rng.standard_normal((8, 64))
    x = _correlated_inputs(rng, 1024, 64, mixing)  # calibration rows
    x_new = _correlated_inputs(rng, 1024, 64, mixing)  # other rows of the same distribution
    w = rng.standard_normal((48, 64))
    hessian = x.T @ x / len(x)
    q_rtn, scale = quantize_rtn(w)
    q_gptq, scale_gptq = gptq_quantize(w, hessian)
    assert np.array_equal(scale_gptq, scale)  # same grid, only the integers differ
    w_rtn, w_gptq = dequantize_weight(q_rtn, scale), dequantize_weight(q_gptq, scale)
    assert output_error(w, w_gptq, hessian) < output_error(w, w_rtn, hessian)
    for rows in (x, x_new):
        err_gptq = np.linalg.norm(rows @ (w - w_gptq).T)
        err_rtn = np.linalg.norm(rows @ (w - w_rtn).T)
        assert err_gptq < err_rtn


def test_gptq_with_an_identity_hessian_is_round_to_nearest():
    w = np.random.default_rng(7).standard_normal((16, 32))
    q, scale = gptq_quantize(w, np.eye(32), damp=0.0)
    assert np.array_equal(q, round_to_grid(w, channel_scales(w)))


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory):
    cfg = ModelConfig(num_layers=2, num_routed_experts=4, seed=3)
    state = init_state(cfg, cfg.seed)
    stream = np.random.default_rng(0).integers(0, 256, 4000)
    cal = calibrate(
        build_model(cfg),
        stream,
        window_len=32,
        batch_windows=2,
        min_tokens_per_expert=8,
        max_windows=8,
        seed=0,
    )
    out, info = quantize_state(state, cal, QuantOptions(method="smooth+gptq"))
    path = tmp_path_factory.mktemp("int8") / "model_int8.h5"
    save_quantized(cfg, out, info, path)
    return cfg, state, out, path


def test_a_quantized_checkpoint_loads_with_int8_projections(quantized_file):
    cfg, _, out, path = quantized_file
    info = read_quant_info(path)
    assert info["method"] == "smooth+gptq" and len(info["projections"]) == (
        4 * 3 + 3 + 2 * (4 + 1) * 3  # 2 layers + MTP: MLA each, 1 dense MLP, 2 MoE x 5 experts
    )
    model = load_model(path, expected=ModelConfig(**{**vars(cfg), "weights": str(path)}))
    attn, expert = model.layers[1].attn, model.layers[1].ffn.experts[2]
    assert isinstance(attn.wq_b, QuantLinear) and isinstance(attn.wkv_b, Linear)
    name = "layers.1.ffn.experts.2.w2"
    assert np.array_equal(expert.w2.wt.T, out[name + ".weight"].astype(np.float64))
    assert np.array_equal(expert.w2.weight_scale, out[name + ".weight_scale"])
    assert np.array_equal(expert.w2.smooth, out[name + ".smooth_scale"])


def test_int8_mla_follows_the_float_mla_it_stands_for(quantized_file):
    """The unabsorbed INT8 path (Wq_b, W_UK, W_UV, Wo apart) against the float model."""
    cfg, state, _, path = quantized_file
    tokens = np.random.default_rng(1).integers(0, 256, 24)
    ref, _ = forward_windows(build_model(cfg), tokens[None])
    float_model = build_model(cfg)
    for block in float_model.layers:
        block.attn.use_projections()
    unabsorbed, _ = forward_windows(float_model, tokens[None])
    np.testing.assert_allclose(unabsorbed, ref, rtol=1e-9, atol=1e-9)
    int8, _ = forward_windows(load_model(path), tokens[None])
    # A sanity bound, not a measurement: a wiring error (a weight of another model, a transposed
    # one) moves the logits by as much as they range.
    assert np.abs(int8 - ref).max() < 0.1 * np.abs(ref).max()
    assert not np.array_equal(int8, ref)


def test_a_quantized_checkpoint_with_a_projection_the_model_lacks_is_refused(
    quantized_file, tmp_path
):
    cfg, _, out, _ = quantized_file
    bad = tmp_path / "bad.h5"
    info = {"projections": ["layers.0.attn.wkv_b.weight"], "smoothed": []}
    save_quantized(cfg, out, info, bad)
    with pytest.raises(ConfigError, match="wkv_b"):
        load_model(bad)


def _int8_cache(num_slots: int = 12) -> LatentCache:
    return LatentCache(
        num_layers=2,
        num_slots=num_slots,
        kv_lora_rank=32,
        rope_dim=8,
        dtype=np.float64,
        latent_int8=True,
    )


def test_int8_latent_cache_keeps_each_token_within_half_its_step_and_the_rope_key_exact():
    rng = np.random.default_rng(8)
    cache, slots = _int8_cache(), np.array([3, 0, 7, 11])
    latent, rope = (
        rng.standard_normal((4, 32)) * [[1], [10], [0.1], [3]],
        rng.standard_normal((4, 8)),
    )
    cache.write(1, slots, latent, rope)
    keys = cache.gather(1, slots)  # [4, 32 + 8]
    step = cache.latent_scale[1, slots].astype(np.float64)[:, None]
    assert np.all(np.abs(keys[:, :32] - latent) <= step / 2 * (1 + 1e-6))
    assert np.array_equal(keys[:, 32:], rope)
    assert cache.latent.dtype == np.int8
    # Per layer: 32 INT8 values + a float32 scale + 8 float64 RoPE values.
    assert cache.token_nbytes == 2 * (32 + 4 + 8 * 8)


def test_a_packed_int8_cache_unpacks_bit_for_bit_into_other_slots():
    rng = np.random.default_rng(9)
    sender, receiver = _int8_cache(), _int8_cache()
    for layer in range(2):
        sender.write(layer, np.arange(5), rng.standard_normal((5, 32)), rng.standard_normal((5, 8)))
    buf = np.concatenate(sender.pack(np.arange(5)))
    assert buf.nbytes == 5 * sender.token_nbytes
    assert receiver.unpack(np.array([6, 7, 8, 9, 10]), buf) == buf.nbytes
    for layer in range(2):
        assert np.array_equal(
            receiver.gather(layer, np.arange(6, 11)), sender.gather(layer, np.arange(5))
        )


def _colocated(overrides):
    return load_config(REPO_ROOT / "configs" / "colocated.yaml", overrides)


def test_an_int8_checkpoint_of_another_shape_is_refused_before_launch(quantized_file):
    _, _, _, path = quantized_file  # 2 layers, 4 routed experts; colocated has 4 and 16
    with pytest.raises(ConfigError) as refused:
        DeploymentPlan.build(_colocated([f"model.weights={path}"]))
    assert "model.num_layers: checkpoint 2 vs config 4" in str(refused.value)
    assert "model.num_routed_experts: checkpoint 4 vs config 16" in str(refused.value)


def test_an_int8_checkpoint_missing_a_scale_is_refused_before_launch(quantized_file, tmp_path):
    cfg, _, out, _ = quantized_file
    bad = tmp_path / "no_scale.h5"
    info = read_quant_info(quantized_file[3])
    save_quantized(
        cfg, {k: v for k, v in out.items() if k != "layers.1.attn.wo.weight_scale"}, info, bad
    )
    overrides = [
        f"model.weights={bad}",
        "model.num_layers=2",
        "model.num_routed_experts=4",
        "model.seed=3",
        "deployment.dp_groups_per_domain=4",
    ]
    with pytest.raises(
        ConfigError, match=r"missing or unexpected: layers\.1\.attn\.wo\.weight_scale"
    ):
        DeploymentPlan.build(_colocated(overrides))
    as_float = tmp_path / "float_ints.h5"  # the integers stored as float: not an INT8 tensor
    save_quantized(
        cfg,
        {**out, "layers.1.attn.wo.weight": out["layers.1.attn.wo.weight"].astype(np.float32)},
        info,
        as_float,
    )
    overrides[0] = f"model.weights={as_float}"
    with pytest.raises(
        ConfigError, match=r"layers\.1\.attn\.wo\.weight is float32\[128, 64\], expected int8"
    ):
        DeploymentPlan.build(_colocated(overrides))


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--calib-text", "/nonexistent/calib.txt"],
            "--calib-text '/nonexistent/calib.txt' does not exist",
        ),
        (["--weights", "tiny-int8"], "already an INT8 checkpoint"),
        (
            ["--min-tokens-per-expert", "5000", "--max-calib-windows", "100"],
            r"--min-tokens-per-expert\(5000\) cannot be reached: --max-calib-windows\(100\) x "
            r"--window\(128\) x top_k\(2\) / num_routed_experts\(16\) = 1600",
        ),
        (["--alpha", "1.5"], r"--alpha must lie in \[0, 1\], got 1.5"),
        (["--window", "0"], "--window must be >= 1, got 0"),
    ],
)
def test_quantize_refuses_bad_inputs_before_reading_any_text(argv, message, capsys, tmp_path):
    from launch.cli.main import main

    assert main(["quantize", "--out", str(tmp_path / "x.h5"), *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("min_tokens", [1, 10_000])
def test_calibration_grows_until_every_expert_has_its_minimum_or_the_cap(min_tokens):
    cfg = ModelConfig(num_layers=2, num_routed_experts=4, num_mtp_modules=0)
    stream = np.random.default_rng(0).integers(0, 256, 4000)
    cal = calibrate(
        build_model(cfg),
        stream,
        window_len=32,
        batch_windows=2,
        min_tokens_per_expert=min_tokens,
        max_windows=6,
        seed=0,
    )
    [counts] = cal.expert_tokens.values()  # one MoE layer
    # Every routed row reaches top_k experts: the counts add up to windows x tokens x top_k.
    assert sum(counts) == cal.num_windows * 32 * cfg.top_k
    if min_tokens == 1:  # the first batch of 2 windows already reached every expert
        assert cal.num_windows == 2 and min(counts) >= 1 and not cal.short_experts
    else:  # the cap: every expert stays short and is listed with its rows
        assert cal.num_windows == 6
        assert cal.short_experts == {f"layers.1.ffn.experts.{e}.": n for e, n in enumerate(counts)}


def test_kv_memory_counts_the_int8_latent_and_its_scale_per_token_and_layer():
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.model.shapes import cost_shape
    from xds_mpi.plan.kv_memory import KvMemory
    from xds_mpi.projection.cost import CostModel, Hardware

    cfg = _colocated(["scheduler.kv_int8=false"])
    m, big = cfg.model, cost_shape()
    kv = KvMemory.of(cfg, big)
    layers = m.num_layers + cfg.scheduler.mtp_depth
    assert kv.float_token_bytes == layers * (m.kv_lora_rank + m.qk_rope_dim) * 8
    assert kv.int8_token_bytes == layers * (m.kv_lora_rank + 4 + m.qk_rope_dim * 8)
    assert kv.same_bytes_blocks == kv.pool_bytes // (kv.int8_token_bytes * 16)
    assert kv.same_bytes_blocks > kv.num_blocks
    assert kv.cost_int8_bytes == big.kv_lora_rank + 4 + 2 * big.qk_rope_dim
    hw = Hardware.from_profile(load_profile(cfg.hardware.profile))
    # The cost model's attention reads the cache with those bytes.
    assert CostModel(big, hw, kv_int8=True).kv_token_bytes == kv.cost_int8_bytes
    assert CostModel(big, hw).kv_token_bytes == kv.cost_float_bytes
