"""The 910C cost model, the analytic projection, and its agreement with the emulated clocks."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.projection.cost import CostModel, Hardware, expected_max_z
from xds_mpi.projection.imbalance import Imbalance, from_run_file
from xds_mpi.projection.project import project

HW = Hardware.from_profile(load_profile("ascend910c"))
BIG = cost_shape()
XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def test_the_profile_numbers_come_from_the_papers_tables():
    assert (HW.int8_ops, HW.bf16_flops, HW.hbm_bytes_per_s) == (752e12, 376e12, 1.6e12)
    assert (HW.gemm_eff, HW.mla_eff, HW.mem_eff) == (0.80, 0.654, 0.841)
    assert HW.graph_launch_s == pytest.approx(0.7e-3)  # [001] §4.2.4: 0.6-0.8 ms per graph


def test_a_gemm_is_a_roofline_of_int8_compute_and_weight_reads():
    cost = CostModel(BIG, HW)
    params = 7168 * 2048 * 3
    # One row: reading the INT8 weights dominates.
    assert cost.gemm(1, params) == pytest.approx(params / (1.6e12 * 0.841))
    # 4096 rows: compute dominates.
    assert cost.gemm(4096, params) == pytest.approx(2 * 4096 * params / (752e12 * 0.80))
    assert cost.gemm(0, params) == 0.0


def test_mla_prolog_prices_the_absorbed_weights_in_bf16():
    """xDeepServe §4.7 quantizes W_q_a, W_kv_a, W_q_b and W_o to INT8; the absorbed per-head
    W_UK and W_UV (128 x 128 x 512 each) stay BF16: at one row, reading them costs twice their
    INT8 price."""
    cost = CostModel(BIG, HW)
    int8 = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 128 * 128 * 7168
    absorbed = 2 * 128 * 128 * 512
    memory = 1.6e12 * 0.841
    assert cost.mla_prolog(1) == pytest.approx(int8 / memory + 2 * absorbed / memory)
    assert cost.mla_prolog(0) == 0.0


def test_attention_and_transfers_follow_their_formulas():
    cost = CostModel(BIG, HW)
    width = 512 + 64
    flops = 2 * 128 * 3000 * (width + 512)
    assert cost.attention([(3000, 1)]) == pytest.approx(
        max(flops / (376e12 * 0.654), 3000 * width * 2 / (1.6e12 * 0.841))
    )
    # One peer: the kernel start, one flag write and one pull, the bytes at the read bandwidth
    # (no slowest-peer wait with a single die).
    assert cost.dispatch(1024, peers=1) == pytest.approx(
        HW.dispatch_start_s + 2.1e-6 + 1.9e-6 + 1024 * 7172 / 164e9
    )
    assert cost.combine(1024, peers=1) == pytest.approx(
        HW.combine_start_s + 4.0e-6 + 1024 * 7168 * 2 / 164e9
    )


def test_int8_attention_and_the_int8_kv_cache_price_what_000_section_4_7_says():
    """[000] §4.7: the non-RoPE latent in INT8 (+ a 4-byte scale per token) and, on a share of
    the layers, the attention core on the INT8 peak. Crafted cases: one row per sequence over a
    long cache is memory-bound, so the INT8 KV reads fewer bytes and is faster; 64 rows per
    sequence are compute-bound, so INT8 attention on every layer halves the core's time and on
    half of them takes the mean of the two. (DeepSeek-V3's 128 heads keep even one row per
    sequence compute-bound on the 910C, so the memory-bound case has 16.)"""
    few = replace(BIG, num_heads=16)
    bf16, int8_kv = CostModel(few, HW), CostModel(few, HW, kv_int8=True)
    memory = 1.6e12 * 0.841
    long = [(8192, 1)] * 4
    assert int8_kv.attention(long) == pytest.approx(4 * 8192 * (512 + 4 + 64 * 2) / memory)
    assert (
        int8_kv.attention(long)
        < bf16.attention(long)
        == pytest.approx(4 * 8192 * (512 + 64) * 2 / memory)
    )
    bf16 = CostModel(BIG, HW)
    wide = [(4096, 64)] * 4
    flops = 4 * 2 * 64 * 128 * 4096 * (576 + 512)
    assert bf16.attention(wide) == pytest.approx(flops / (376e12 * 0.654))
    every = CostModel(BIG, HW, kv_int8=True, int8_attention=1.0)
    assert every.attention(wide) == pytest.approx(flops / (752e12 * 0.654))
    half = CostModel(BIG, HW, kv_int8=True, int8_attention=0.5)
    assert half.attention(wide) == pytest.approx((bf16.attention(wide) + every.attention(wide)) / 2)
    with pytest.raises(ValueError, match="share of the layers"):
        CostModel(BIG, HW, int8_attention=1.5)


def test_the_gate_and_the_head_keep_bf16_weights():
    """[000] §4.7 quantizes the MLA, MoE and MLP modules, not the router or the LM head
    ([001] §4.5 keeps "critical gating mechanisms" in BF16 or FP32): at a few rows reading
    them costs 2 bytes per weight, twice an INT8 GEMM of the same shape."""
    cost = CostModel(BIG, HW)
    memory = 1.6e12 * 0.841
    head, gate = 7168 * 129280, 7168 * 256
    assert cost.head(8) == pytest.approx(2 * head / memory)
    assert cost.gate(8) == pytest.approx(2 * gate / memory)
    assert cost.head(8) == pytest.approx(2 * cost.gemm(8, head))


@pytest.mark.parametrize("config, batch", [("ep288", 60), ("afd_pod", 96)])
def test_the_projection_adds_up(config, batch):
    cfg = load_config(REPO_ROOT / "configs" / f"{config}.yaml")
    p = project(cfg, BIG, HW, batch_per_die=batch, kv_len=3072, mtp_depth=1, accept_rate=0.9)
    assert sum(p.breakdown_s.values()) == pytest.approx(p.iteration_s)
    assert p.tpot_s == pytest.approx(p.iteration_s / 1.9)
    num_attention = 288 if config == "ep288" else 480
    chips = (288 if config == "ep288" else 768) / 2
    assert p.tokens_per_s_per_chip == pytest.approx(
        batch * num_attention * 1.9 / p.iteration_s / chips
    )


def test_project_refuses_bad_numbers():
    result = subprocess.run(
        [str(XDS_MPI), "project", "ep288", "--accept", "1.5"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert result.returncode == 2 and "0 <= --accept <= 1" in result.stderr


PROBE = REPO_ROOT / "tests" / "data" / "probe_hw.yaml"
PROBE_SETTINGS = [
    f"hardware.profile={PROBE}",
    "deployment.redundant_slots_per_die=1",  # EPLB's collection records each die's rows;
    "eplb.enabled=true",  # one slice per iteration, and never a rebalance (1000 slices)
    "eplb.interval=1",
    "eplb.slices=1000",
    "workload.num_requests=16",
    "workload.prompt_len=64",
    "workload.output_len=8",
    "workload.ignore_eos=true",
]


def _probe_run(tmp_path, *, mtp_depth: int = 0):
    """(each die's batch per iteration [dies, iterations], decode-only iterations, the slowest
    die's virtual seconds of each decode iteration) of a colocated run on the probe profile;
    with MTP a decode iteration verifies 1 + depth rows per sequence."""
    extra = [f"run.output_dir={tmp_path}", "run.name=p", f"scheduler.mtp_depth={mtp_depth}"]
    settings = [x for kv in PROBE_SETTINGS + extra for x in ("--set", kv)]
    run = subprocess.run(
        [str(XDS_MPI), "run", "colocated", *settings],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with h5py.File(tmp_path / "p.h5") as f:
        dies = [f["dies"][d] for d in f["dies"]]
        # Dies that got their requests an iteration apart finish apart too: the DP groups'
        # batches differ, and the emulated iteration is the slowest die's.
        batch = np.array([d["num_sampled"][:] for d in dies])
        rows = np.array([d["num_rows"][:] for d in dies])
        decode = np.all(rows == (1 + mtp_depth) * batch, axis=0) & (batch.sum(axis=0) > 0)
        emulated = np.max([d["vtime_s"][:] for d in dies], axis=0)[decode]
        summary_ms = f["summary"].attrs["projected_iteration_ms"]
    assert emulated.mean() * 1e3 == pytest.approx(summary_ms)
    return batch, decode, emulated


def test_the_emulated_clock_on_skewed_routing_agrees_with_the_projection_of_its_loads(tmp_path):
    """The trained checkpoint routes unevenly (the hottest die ~2x the mean). The emulated
    clocks price every die's own rows and wait at the barriers; the analytic projection is given
    the measured max/mean die load and, per iteration, the mean DP batch and the largest over
    it. On the probe profile attention, dispatch/combine and the expert imbalance each take
    >= 10 % of the iteration (about 16 %, 13 % and 24 %)."""
    batches, decode, emulated = _probe_run(tmp_path)
    mean, largest = batches.mean(axis=0)[decode], batches.max(axis=0)[decode]
    moe = from_run_file(tmp_path / "p.h5")
    assert 1.5 < moe < 3.0  # the checkpoint's skew, measured
    cfg = load_config(REPO_ROOT / "configs" / "colocated.yaml", PROBE_SETTINGS[1:2])
    probe = Hardware.from_profile(load_profile(str(PROBE)))
    kv = 64 + 8 / 2  # mean KV length over the decode iterations

    def analytic(moe_load):
        return np.array([
            project(cfg, BIG, probe, batch_per_die=b, kv_len=kv,
                    imbalance=Imbalance(moe=moe_load, batch=top / b, noise=False))
            for b, top in zip(mean, largest, strict=True)
        ])  # fmt: skip

    skewed, uniform = analytic(moe), analytic(1.0)
    iteration = np.mean([p.iteration_s for p in skewed])
    assert emulated.mean() == pytest.approx(iteration, rel=0.05)
    assert np.mean([p.iteration_s for p in uniform]) < 0.85 * emulated.mean()
    full = skewed[np.argmax(mean)]
    moe_layers = BIG.num_layers - BIG.num_dense_layers
    comm = (full.primitives_s["dispatch"] + full.primitives_s["combine"]) * moe_layers
    even = uniform[np.argmax(mean)]
    for share in (
        full.breakdown_s["attention"] / full.iteration_s,
        comm / full.iteration_s,
        1 - even.iteration_s / full.iteration_s,
    ):
        assert share >= 0.10


def test_with_mtp_the_emulated_clock_agrees_with_the_projection_where_each_part_matters(
    tmp_path,
):
    """The same skewed run with MTP depth 1 (the trained checkpoint's drafts, acceptance
    measured): each iteration an MTP pass over the tokens the last verification committed,
    then the main pass over 2 rows per sequence. The emulated clocks price every die's own rows
    and wait at the barriers; the analytic projection takes the measured acceptance, max/mean
    expert load and per-iteration DP batches. Over the decode iterations (time-weighted, from
    the projection): attention, the dispatch/combine calls, the waits in them and the expert
    imbalance each take >= 10 % of the time (recomputed here; docs/projection.md states them),
    and the two clocks agree within 5 %."""
    batches, decode, emulated = _probe_run(tmp_path, mtp_depth=1)
    with h5py.File(tmp_path / "p.h5") as f:
        accept = float(f["summary"].attrs["mtp_acceptance"])
    assert 0.2 < accept < 0.9  # drafts of the trained checkpoint: some accepted, not all
    mean, largest = batches.mean(axis=0)[decode], batches.max(axis=0)[decode]
    moe = from_run_file(tmp_path / "p.h5")
    cfg = load_config(REPO_ROOT / "configs" / "colocated.yaml", PROBE_SETTINGS[1:2])
    probe = Hardware.from_profile(load_profile(str(PROBE)))
    kv = 64 + 8 / 2

    def analytic(moe_load):
        return [
            project(cfg, BIG, probe, batch_per_die=b, kv_len=kv, mtp_depth=1,
                    accept_rate=accept, imbalance=Imbalance(moe=moe_load, batch=top / b,
                                                            noise=False))
            for b, top in zip(mean, largest, strict=True)
        ]  # fmt: skip

    skewed, uniform = analytic(moe), analytic(1.0)
    total = sum(p.iteration_s for p in skewed)
    assert emulated.mean() == pytest.approx(total / len(skewed), rel=0.05)
    calls = BIG.num_layers - BIG.num_dense_layers + 1  # the main pass's MoE layers + MTP's
    prim = [p.primitives_s for p in skewed]
    shares = {
        "attention": sum(p.breakdown_s["attention"] + p.breakdown_s["MTP attention"]
                         for p in skewed),
        "dispatch/combine calls": calls * sum(q["dispatch"] + q["combine"] for q in prim),
        "waits": calls * sum(q["dispatch wait"] + q["combine wait"] for q in prim),
        "expert imbalance": total - sum(p.iteration_s for p in uniform),
        "MTP pass": sum(q["MTP pass"] for q in prim),
    }  # fmt: skip
    shares = {k: v / total for k, v in shares.items()}
    for part in ("attention", "dispatch/combine calls", "waits", "expert imbalance"):
        assert shares[part] >= 0.10, shares
    assert shares["MTP pass"] > 0


def test_the_h800_profile_projects_the_same_deployment():
    h800 = Hardware.from_profile(load_profile("h800"))
    # FlashMLA's README at the decode profile's release: 580 of 989 TFLOPS
    assert (h800.bf16_flops, h800.mla_eff, h800.mem_eff) == (989e12, 0.586, 0.896)
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml")
    p = project(cfg, BIG, h800, batch_per_die=60, kv_len=3072, mtp_depth=1, accept_rate=0.9)
    # The bytes from the 280 peers outside the node over the 50 GB/s NIC (the 8 inside come
    # over NVLink at once) instead of all over the 164 GB/s UB read: the byte terms of one
    # dispatch scale by 164 / 50 x 280 / 288 (starts, the call's latency and the wait out).
    ascend = project(cfg, BIG, HW, batch_per_die=60, kv_len=3072, mtp_depth=1, accept_rate=0.9)

    def byte_term(hw, d):
        wait = hw.jitter_s * expected_max_z(288)
        return d - hw.dispatch_start_s - (hw.write_latency_s + hw.read_latency_s) - wait

    ratio = byte_term(h800, p.primitives_s["dispatch"]) / byte_term(
        HW, ascend.primitives_s["dispatch"]
    )
    assert ratio == pytest.approx(164 / 50 * (1 - 8 / 288), rel=1e-6)


def test_the_emulators_mtp_pass_prices_eh_proj_as_the_projection_does():
    """The die's Pricer adds an MTP module's eh_proj over its block's rows under "MTP eh_proj"
    (the projection's MTP pass holds the same term)."""
    from xccl.vclock import VirtualClock
    from xds_mpi.config.schema import ModelConfig
    from xds_mpi.execution.pricing import Pricer

    cost = CostModel(BIG, HW)
    pricer = Pricer(cost, ModelConfig(), VirtualClock(), num_routed_dies=4, use_int8=True)
    with pricer.mtp_layer():
        pricer.mtp_projection(114)
    assert pricer.spent["MTP eh_proj"] == pytest.approx(cost.mtp_projection(114))
    assert cost.mtp_projection(114) == pytest.approx(
        max(2 * 114 * 2 * 7168**2 / (376e12 * 0.80), 2 * 7168**2 * 2 / (1.6e12 * 0.841))
    )
