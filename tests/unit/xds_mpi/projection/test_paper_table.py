"""The projection against the papers: the validation table is the cost model's output (each
projected value recomputed here from `project`), the calibration constants are Table 7's fit,
and the dispatch/combine mechanism grows with EP by the slowest peer (and, on two tiers, the
bytes leaving the node)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from harness import REPO_ROOT

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.topology import Topology
from xds_mpi.projection.cost import CostModel, Hardware, expected_max_z
from xds_mpi.projection.imbalance import (
    Imbalance,
    batch_from_run_file,
    from_run_file,
    from_skew,
    kv_straggler,
)
from xds_mpi.projection.layers import counts
from xds_mpi.projection.paper_data import SCENARIOS, VALIDATION
from xds_mpi.projection.paper_table import calibration_table, validation_table
from xds_mpi.projection.project import Execution, project
from xds_mpi.projection.waits import slowest_call_wait_s, stragglers

BIG = cost_shape()
XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def _recompute(pub, hw: Hardware) -> float:
    """A validation row's projected value, from the scenario's published conditions."""
    s = SCENARIOS[pub.scenario]
    cfg = load_config(REPO_ROOT / "configs" / f"{s.config}.yaml", list(s.overrides))
    if s.xccl_starts == "fig20 min":
        hw = _fig20_starts(hw)
    if s.straggler_tail:  # [000] §4.4's tail, the profile's assumed parameters (waits.py)
        hw = replace(hw, tail=stragglers(load_profile("ascend910c")))
    groups = cfg.deployment.num_dp_domains * cfg.deployment.dp_groups_per_domain
    imbalance = Imbalance(
        moe=from_skew(cfg, BIG, hottest=s.skew[0], share=s.skew[1], drift_sigma=s.drift_sigma)
        if s.skew
        else 1.0,
        kv=kv_straggler(batch=s.batch, spread=s.kv_spread, groups=groups),
    )

    def projected(microbatches, stream0_aic):
        return project(
            cfg, BIG, hw, batch_per_die=s.batch, kv_len=s.kv_len, mtp_depth=s.mtp_depth,
            accept_rate=s.accept, imbalance=imbalance, redundant_dies=s.redundant_dies,
            int8_attention=s.int8_attention,
            execution=Execution(microbatches=microbatches, pipelined_graphs=s.pipelined_graphs,
                                stream0_aic=stream0_aic, scheduling_bubble=s.scheduling_bubble),
        )  # fmt: skip

    p = projected(s.microbatches, s.stream0_aic)
    if pub.metric.endswith(" max"):  # the slowest call: the latest start of 288 dies x 59 calls
        kind = pub.metric.split()[0]
        q = p.primitives_s
        wait = slowest_call_wait_s(hw.jitter_s, hw.tail, 288, 58 + s.mtp_depth)
        return (q[f"{kind} intrinsic"] + q[f"{kind} imbalance"] + wait) * 1e6
    if pub.metric == "two-stream gain":  # [001] Figure 20a: two streams over one
        one = projected(1, None)
        return 100 * (one.iteration_s / p.iteration_s - 1)
    bubble_ms = hw.bubble_s * 1e3 if s.scheduling_bubble else 0.0
    forward_ms = p.iteration_s * 1e3 - bubble_ms
    b = {k: v * 1e3 for k, v in p.breakdown_s.items()}
    tokens_per_step = 1 + s.mtp_depth * s.accept
    per_die = s.batch * groups * tokens_per_step / p.iteration_s / groups_dies(cfg)
    return {
        "iteration": p.iteration_s * 1e3,
        "forward": forward_ms,
        "scheduling bubble": bubble_ms,
        "tpot": p.iteration_s * 1e3 / tokens_per_step,
        "tokens/s/chip": 2 * per_die,
        "tokens/s/die": per_die,
        "share attention": 100
        * (b.get("attention", math.nan) + b.get("MTP attention", 0))
        / forward_ms,
        "share dispatch+combine": 100
        * sum(b.get(p + k, 0) for p in ("", "MTP ") for k in ("dispatch", "combine"))
        / forward_ms,
        "MTP pass": _mtp_pass_s(cfg, hw, s, imbalance) * 1e3 if s.mtp_depth else math.nan,
    }.get(pub.metric, p.primitives_s.get(pub.metric, math.nan) * 1e6)


def _mtp_pass_s(cfg, hw: Hardware, s, imbalance) -> float:
    """One MTP module's pass: its block (one MoE layer, and the last microbatch's tail where
    the deployment has one) over 1 + depth x acceptance rows per sequence, eh_proj over those
    rows, the shared head and sampling over one row per sequence, the graph's launch."""
    from xds_mpi.projection.layers import LayerInputs, afd_layer, colocated_layer

    cost = CostModel(BIG, hw, kv_int8=cfg.scheduler.kv_int8, int8_attention=s.int8_attention)
    rows_per_seq = 1 + s.mtp_depth * s.accept
    layer = afd_layer if cfg.deployment.kind == "afd" else colocated_layer
    n = counts(cfg, Topology.from_config(cfg), redundant_dies=s.redundant_dies)
    x = LayerInputs(cfg=cfg, cost=cost, n=n, batch=s.batch, kv_len=s.kv_len,
                    rows_per_seq=rows_per_seq, imbalance=imbalance,
                    microbatches=s.microbatches, stream0_aic=s.stream0_aic)  # fmt: skip
    parts, primitives, _ = layer(x)
    launch = 0.0 if s.pipelined_graphs else hw.graph_launch_s
    return (
        sum(parts.values())
        + primitives.get("tail", 0.0)
        + cost.mtp_projection(s.batch * rows_per_seq)
        + cost.head(s.batch)
        + cost.sampling(s.batch)
        + launch
    )


def _fig20_starts(hw: Hardware) -> Hardware:
    """[000]'s XCCL starts: Figure 20's fastest dispatch / combine (seed 004: 185 / 165 us) is
    the 000 colocated mean die's call without waits: start + flags and pulls over 288 peers +
    its bytes in (60 x 2 tokens x top-8 x 288 / 256 routed dies rows in; 120 x (8 + 1) rows
    back, the shared expert on dedicated dies)."""
    cost = CostModel(BIG, hw)
    rows_in, rows_back = 120 * 8 * 288 / 256, 120 * 9
    dispatch = cost.dispatch(rows_in, peers=288) - hw.jitter_s * expected_max_z(288)
    combine = cost.combine(rows_back, peers=288) - hw.jitter_s * expected_max_z(288)
    return replace(
        hw,
        dispatch_start_s=hw.dispatch_start_s + 185e-6 - dispatch,
        combine_start_s=hw.combine_start_s + 165e-6 - combine,
    )


def groups_dies(cfg) -> int:
    dep = cfg.deployment
    experts = dep.num_expert_dies if dep.kind == "afd" else 0
    return dep.num_dp_domains * dep.dp_groups_per_domain + experts


def test_every_projected_value_is_the_cost_models():
    hw = Hardware.from_profile(load_profile("ascend910c"))
    table = validation_table()
    assert [(r.source, r.metric, r.published) for r in table] == [
        (p.source, p.metric, p.value) for p in VALIDATION
    ]
    for row, pub in zip(table, VALIDATION, strict=True):
        assert row.projected == pytest.approx(_recompute(pub, hw), rel=1e-9), row


def test_rows_that_miss_carry_what_they_lack_and_what_the_model_made_them_of():
    """A validation row outside MISS names the mechanism it lacks and carries `why_text` of its
    own scenario's projection (the model's parts and the imbalance it was priced at); a row
    within, a derived row or a calibration row carries neither."""
    from xds_mpi.projection.paper_table import (
        MISS,
        gain_text,
        scenario_inputs,
        scenario_projection,
        why_text,
    )

    for row, pub in zip(validation_table(), VALIDATION, strict=True):
        if abs(row.error) <= MISS or pub.role != "validation":
            assert row.why == row.lacks == ""
            continue
        if pub.metric == "two-stream gain":  # the layer with one stream and with two
            one = scenario_projection(pub.scenario, one_stream=True).primitives_s["layer"]
            assert row.why == gain_text(pub.scenario) and f"{one * 1e6:.0f} us" in row.why
            assert row.lacks == pub.lacks != ""
            continue
        _, _, _, kwargs = scenario_inputs(pub.scenario)
        p = scenario_projection(pub.scenario)
        assert row.why == why_text(p, pub.metric, kwargs["imbalance"])
        assert f"{kwargs['imbalance'].moe:.2f}x" in row.why
        assert row.lacks == pub.lacks != ""


def test_the_mtp_pass_runs_its_block_over_the_committed_tokens():
    """[000] §4.6 / [001] §4.2.4: an MTP module's block takes the tokens the last verification
    committed, 1 + the accepted drafts per sequence: more accepted -> a longer MTP pass; at
    acceptance 1 its block costs what a main layer over 1 + depth rows costs."""
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml")
    hw = Hardware.from_profile(load_profile("ascend910c"))
    work = dict(batch_per_die=60, kv_len=3072, mtp_depth=1)
    passes = [project(cfg, BIG, hw, **work, accept_rate=a).primitives_s["MTP pass"]
              for a in (0.0, 0.5, 0.9, 1.0)]  # fmt: skip
    assert passes == sorted(passes) and passes[0] < passes[-1]
    full = project(cfg, BIG, hw, **work, accept_rate=1.0)
    block = sum(v for k, v in full.parts_s["MTP pass"].items()
                if k not in ("MTP eh_proj", "MTP head", "graph launch"))  # fmt: skip
    assert block == pytest.approx(full.primitives_s["layer"])
    none = project(cfg, BIG, hw, batch_per_die=60, kv_len=3072)
    assert "MTP pass" not in none.primitives_s and not any(
        k.startswith("MTP") for k in none.breakdown_s
    )


def test_000s_xccl_starts_come_from_figure_20s_fastest_calls():
    """[000]'s scenarios take the kernel starts that make their waitless call Figure 20's
    fastest (calibration); [001]'s keep the profile's Table 7 fit."""
    from xds_mpi.projection.paper_table import scenario_inputs

    profile = Hardware.from_profile(load_profile("ascend910c"))
    expected = _fig20_starts(profile)
    for name, s in SCENARIOS.items():
        hw = scenario_inputs(name)[2]
        want = expected if name.startswith("000") else profile
        assert s.xccl_starts == ("fig20 min" if name.startswith("000") else "table7")
        assert hw.dispatch_start_s == pytest.approx(want.dispatch_start_s, rel=1e-9), name
        assert hw.combine_start_s == pytest.approx(want.combine_start_s, rel=1e-9), name
    assert expected.dispatch_start_s > profile.dispatch_start_s


def test_the_waits_come_from_the_models_own_imbalance():
    """A call's wait (mean over dies minus the waitless call): the slowest DP group's attention
    over the mean's (dispatch), the hottest expert die's experts over the typical die's
    (combine), and the last die's start. More batch imbalance -> longer dispatch wait; more
    skew -> longer combine wait; more peers -> longer wait."""
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml")
    hw = Hardware.from_profile(load_profile("ascend910c"))
    cost = CostModel(BIG, hw)
    work = dict(batch_per_die=60, kv_len=3072)
    even = project(cfg, BIG, hw, **work, imbalance=Imbalance(noise=False)).primitives_s
    late = project(cfg, BIG, hw, **work, imbalance=Imbalance(batch=1.5, noise=False)).primitives_s
    hot = project(cfg, BIG, hw, **work, imbalance=Imbalance(moe=2.0, noise=False)).primitives_s
    start = hw.jitter_s * expected_max_z(288)
    assert even["dispatch wait"] == pytest.approx(start)
    assert even["combine wait"] == pytest.approx(start)
    attention = [cost.mla_prolog(b) + cost.attention([(3072, 1)] * b) for b in (60, 90)]
    assert late["dispatch wait"] == pytest.approx(start + attention[1] - attention[0])
    mean_rows = 60 * 288 * 8 / 256
    assert hot["combine wait"] == pytest.approx(
        start + cost.routed(2 * mean_rows, 1) - cost.routed(mean_rows, 1)
    )
    assert late["dispatch wait"] > even["dispatch wait"] < hot["dispatch wait"] + 1e-12
    assert hot["combine wait"] > even["combine wait"]
    small = load_config(REPO_ROOT / "configs" / "ep288.yaml",
                        ["deployment.dp_groups_per_domain=64"])  # fmt: skip
    fewer = project(small, BIG, hw, **work, imbalance=Imbalance(noise=False)).primitives_s
    assert fewer["dispatch wait"] < even["dispatch wait"]


def test_the_table_counts_independent_validation_rows_only():
    """Derived rows (arithmetic of published numbers) and calibration rows are shown and not
    counted; the counts are the validation rows' own errors."""
    from xds_mpi.projection.paper_data import Published
    from xds_mpi.projection.paper_table import Counts

    table = validation_table()
    valid = [r for r in table if r.role == "validation"]
    errors = [abs(r.projected / r.published - 1) for r in valid]
    n = Counts.of(table)
    assert (n.validation, n.within_10, n.within_15) == (
        len(valid),
        sum(e <= 0.10 for e in errors),
        sum(e <= 0.15 for e in errors),
    )
    assert n.validation + n.derived + n.calibration == len(table)
    assert all(r.derived_from for r in table if r.role == "derived")
    # every scenario with a derived row has an independent row of its own
    derived = {p.scenario for p in VALIDATION if p.role == "derived"} - {"001 b96 4096+256"}
    assert derived <= {p.scenario for p in VALIDATION if p.role == "validation"}
    with pytest.raises(ValueError, match="derived_from"):
        Published(source="x", scenario="x", metric="tpot", value=1.0, unit="ms", role="derived")


def test_the_scheduling_bubble_is_paid_where_its_source_says():
    """[000] §7.1's 2 ms gap sets the profile's bubble (a calibration row from the sentence of
    the 93 ms forward row); [001] runs its graphs back to back (§4.2.4) and pays none."""
    from xds_mpi.projection.paper_table import scenario_projection

    hw = Hardware.from_profile(load_profile("ascend910c"))
    for name, s in SCENARIOS.items():
        b = scenario_projection(name).breakdown_s
        assert s.scheduling_bubble == name.startswith("000"), name
        assert b.get("scheduling bubble", 0.0) == (hw.bubble_s if s.scheduling_bubble else 0.0)
    bubble = [p for p in VALIDATION if p.metric == "scheduling bubble"]
    assert [p.role for p in bubble] == ["calibration"]
    assert bubble[0].value == pytest.approx(hw.bubble_s * 1e3)


def test_the_drift_the_skewed_scenarios_use_is_the_measured_one():
    """No scenario carries a drift of its own: the papers' benchmarks are fixed sets of
    requests, priced at the drift measured on the checkpoint for that case."""
    from xds_mpi.eplb.drift import DRIFT_SAME_REQUESTS

    assert all(s.drift_sigma == DRIFT_SAME_REQUESTS for s in SCENARIOS.values() if s.skew)


def test_the_table_moves_with_the_hardware_not_with_the_published_numbers():
    """Halving the HBM bandwidth changes every end-to-end projected number (they come from the
    model); no published value appears among the profile's constants."""
    hw = Hardware.from_profile(load_profile("ascend910c"))
    slower = replace(hw, hbm_bytes_per_s=hw.hbm_bytes_per_s / 2)
    for pub in VALIDATION:
        if pub.metric in ("tpot", "iteration"):
            assert _recompute(pub, slower) > _recompute(pub, hw)
    profile = yaml.safe_load((REPO_ROOT / "configs/hardware/ascend910c.yaml").read_text())
    constants = {v for section in profile.values() if isinstance(section, dict)
                 for v in section.values() if not isinstance(v, list)}  # fmt: skip
    assert not constants & {p.value for p in VALIDATION if p.role != "calibration"}


@pytest.mark.parametrize("profile", ["ascend910c", "h800"])
def test_every_profile_constant_names_its_source(profile):
    """Each value line carries a comment; the fitted ones name the calibration table."""
    lines = (REPO_ROOT / "configs" / "hardware" / f"{profile}.yaml").read_text().splitlines()
    code = [ln.split("#")[0] for ln in lines]
    values = [ln for ln, c in zip(lines, code) if ":" in c and c.split(":")[1].strip()]
    assert values and all("#" in ln for ln in values if not ln.startswith("name:"))
    xccl = lines[lines.index("xccl:") : lines.index("efficiency:")]
    assert "Table 7" in " ".join(xccl)
    assert all("fitted" in ln for ln in xccl if ln.startswith("  ") and not ln.startswith("  #"))


@pytest.mark.parametrize("profile", ["ascend910c", "h800"])
def test_the_profiles_xccl_constants_are_table7s_fit(profile):
    fit = calibration_table(profile)
    xccl = load_profile(profile)["xccl"]
    assert xccl["dispatch_start_us"] == pytest.approx(fit.dispatch_start_us, abs=0.05)
    assert xccl["combine_start_us"] == pytest.approx(fit.combine_start_us, abs=0.05)
    assert xccl["die_jitter_us"] == pytest.approx(fit.jitter_us, abs=0.05)
    assert len(fit.rows) == 12


def test_dispatch_grows_with_ep_from_the_slowest_peer():
    """The flags and pulls are pipelined: one write and one read latency per call, however many
    peers; the growth with EP is the wait for the slowest of more dies."""
    hw = Hardware.from_profile(load_profile("ascend910c"))
    cost = CostModel(BIG, hw)
    rows = 128 * 8
    for ep in (8, 16, 64, 256):
        expected = (
            hw.dispatch_start_s
            + (2.1e-6 + 1.9e-6)
            + rows * (7168 + 4) / 164e9
            + hw.jitter_s * expected_max_z(ep)
        )
        assert cost.dispatch(rows, peers=ep) == pytest.approx(expected)
    assert cost.dispatch(rows, peers=256) > cost.dispatch(rows, peers=8)


def test_expected_max_and_kv_straggler_follow_their_formulas():
    assert expected_max_z(1) == 0.0
    assert expected_max_z(2) == pytest.approx(0.564, abs=0.03)  # exact: 1/sqrt(pi); Blom's
    assert expected_max_z(288) == pytest.approx(2.90, abs=0.05)
    z = expected_max_z(288)
    assert kv_straggler(batch=60, spread=1 / 3, groups=288) == pytest.approx(
        1 + z * (1 / 3) / math.sqrt(180)
    )
    assert kv_straggler(batch=60, spread=0.0, groups=288) == 1.0


def test_a_moe_layer_is_priced_at_the_hottest_die():
    """Even expected loads still leave one iteration's routing noise: the hottest of 256
    Poisson counts of mean R is R + z(256) sqrt(R); a skew of 2x the mean is above that."""
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml")
    hw = Hardware.from_profile(load_profile("ascend910c"))
    cost = CostModel(BIG, hw)
    work = dict(batch_per_die=60, kv_len=3072, mtp_depth=0)
    even = project(cfg, BIG, hw, **work)
    hot = project(cfg, BIG, hw, **work, imbalance=Imbalance(moe=2.0))
    mean_rows = 60 * 288 * 8 / 256  # one routed expert per routed die
    noisy = mean_rows + expected_max_z(256) * math.sqrt(mean_rows)
    # the layer waits for the slower of the hottest routed die and the shared-expert dies
    shared = cost.experts([60 * 288 / 32])
    extra = (max(cost.routed(2 * mean_rows, 1), shared) - max(cost.routed(noisy, 1), shared)) + (
        cost.dispatch(2 * mean_rows, peers=288) - cost.dispatch(noisy, peers=288)
    )
    assert hot.primitives_s["layer"] - even.primitives_s["layer"] == pytest.approx(extra)
    assert even.primitives_s["dispatch"] == pytest.approx(cost.dispatch(noisy, peers=288))


def test_the_moe_stream_runs_on_its_share_of_the_cores():
    """Two microbatches ([001] §4.2.3): stream 1's experts run on 8 of the 24 AIC, its dispatch
    on 16 of the 48 AIV at the whole die's price (the sends are pipelined); the shared expert
    runs on 32 dies when 32 of the 64 non-routed dies hold routed replicas."""
    cfg = load_config(
        REPO_ROOT / "configs" / "ep288.yaml", list(SCENARIOS["001 b8 4096+256"].overrides)
    )
    hw = Hardware.from_profile(load_profile("ascend910c"))
    work = dict(batch_per_die=48, kv_len=4224, mtp_depth=1, accept_rate=0.7,
                execution=Execution(microbatches=2, stream0_aic=16), redundant_dies=32)  # fmt: skip
    p = project(cfg, BIG, hw, **work)
    stream1 = CostModel(BIG, replace(hw, aiv_cores=16, int8_ops=hw.int8_ops / 3))
    mean_rows = 24 * 2 * 320 * 8 / 256
    noisy = mean_rows + expected_max_z(256) * math.sqrt(mean_rows)
    assert p.primitives_s["dispatch"] == pytest.approx(stream1.dispatch(noisy, peers=320))
    assert stream1.dispatch(noisy, peers=320) == pytest.approx(
        CostModel(BIG, hw).dispatch(noisy, peers=320)
    )
    n = counts(cfg, Topology.from_config(cfg), redundant_dies=32)
    assert (n["routed_dies"], n["shared_dies"]) == (256, 32)
    one_stream = project(cfg, BIG, hw, **{**work, "execution": Execution()})
    assert one_stream.primitives_s["dispatch"] == pytest.approx(
        CostModel(BIG, hw).dispatch(
            2 * mean_rows + expected_max_z(256) * math.sqrt(2 * mean_rows), peers=320
        )
    )


def _ep320(hw, **execution):
    cfg = load_config(
        REPO_ROOT / "configs" / "ep288.yaml", list(SCENARIOS["001 b8 4096+256"].overrides)
    )
    work = dict(batch_per_die=48, kv_len=4096, mtp_depth=1, accept_rate=0.7, redundant_dies=32)
    return project(cfg, BIG, hw, **work, execution=Execution(pipelined_graphs=True, **execution))


def test_two_streams_take_twice_the_longer_stream_at_the_balanced_split():
    """[001] §4.2.3: each stream runs both microbatches per layer; without a stated split the
    AIC go where the longer stream is shortest; at the stated split (16 AIC) the streams are
    what that split prices."""
    hw = Hardware.from_profile(load_profile("ascend910c"))
    balanced = _ep320(hw, microbatches=2)
    s0, s1 = balanced.primitives_s["stream 0"], balanced.primitives_s["stream 1"]
    assert balanced.primitives_s["layer"] == pytest.approx(2 * max(s0, s1))
    for aic in range(8, 21):
        fixed = _ep320(hw, microbatches=2, stream0_aic=aic)
        assert fixed.primitives_s["layer"] >= balanced.primitives_s["layer"] - 1e-12
    assert _ep320(hw, microbatches=2, stream0_aic=16).parts_s.get("stream 0 AIC") == 16


def test_overlap_is_not_slower_than_one_stream_when_bytes_on_the_link_dominate():
    """Crafted: a link 20x narrower makes the MoE path mostly moving bytes (which halve with
    the microbatch and need no cube), so the other microbatch's attention hides them: two
    streams beat one."""
    hw = Hardware.from_profile(load_profile("ascend910c"))
    slow = replace(hw, read_bytes_per_s=hw.read_bytes_per_s / 20)
    one, two = _ep320(slow), _ep320(slow, microbatches=2)
    assert two.primitives_s["layer"] < one.primitives_s["layer"]


def test_loads_measured_in_a_run_file(tmp_path):
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as f:  # [slices, layers, dies]; slice 0 held a prefill
        f["eplb/slice_die_rows"] = np.array([[[9, 1], [2, 2]], [[3, 1], [1, 3]]], np.float64)
        f["eplb/slice_num_prefill"] = np.array([1, 0])
    assert from_run_file(path) == pytest.approx(1.5)


def test_the_slowest_dp_groups_batch_measured_and_priced(tmp_path):
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as f:  # iteration 0 holds a prompt; die 2 is an expert die
        for die, sampled, rows in ((0, [2, 3, 1], [9, 3, 1]), (1, [2, 1, 3], [2, 1, 3]),
                                   (2, [0, 0, 0], [0, 0, 0])):  # fmt: skip
            f[f"dies/{die}/num_sampled"] = np.array(sampled)
            f[f"dies/{die}/num_rows"] = np.array(rows)
            f[f"dies/{die}/num_drafted"] = np.zeros(3, np.int64)
    assert batch_from_run_file(path) == pytest.approx((3 / 2 + 3 / 2) / 2)
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml")
    hw = Hardware.from_profile(load_profile("ascend910c"))
    cost = CostModel(BIG, hw)
    work = dict(batch_per_die=60, kv_len=3072)
    even = project(cfg, BIG, hw, **work)
    slow = project(cfg, BIG, hw, **work, imbalance=Imbalance(batch=1.5))
    attention = [cost.mla_prolog(b) + cost.attention([(3072, 1)] * b) for b in (60, 90)]
    delta = slow.primitives_s["layer"] - even.primitives_s["layer"]
    assert delta == pytest.approx(attention[1] - attention[0])


def test_project_paper_and_primitive_print_from_the_model():
    out = subprocess.run(
        [str(XDS_MPI), "project", "--paper"], capture_output=True, text=True, timeout=120,
        cwd=REPO_ROOT, check=True,
    ).stdout  # fmt: skip
    assert "VALIDATION" in out and "CALIBRATION" in out
    table = validation_table()
    for row in table:
        assert f"{row.projected:.1f}" in out
    from xds_mpi.projection.paper_table import Counts

    n = Counts.of(table)
    assert (
        f"independent validation rows: {n.validation}; within +-10 %: {n.within_10}, within "
        f"+-15 %: {n.within_15}. Not counted: {n.derived} derived rows"
    ) in out
    out = subprocess.run(
        [str(XDS_MPI), "project", "--primitive", "combine", "--ep", "8,256", "--tokens", "64",
         "--profile", "h800"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        check=True,
    ).stdout  # fmt: skip
    h800 = CostModel(BIG, Hardware.from_profile(load_profile("h800")))
    for ep in (8, 256):
        assert f"{h800.combine(64 * 8, peers=ep) * 1e6:.1f}" in out
    assert "growth EP8 -> EP256" in out


def test_afd_attention_side_holds_a2e_stage_1_and_each_pass_pays_its_tail():
    """[000] §7.1: the attention die's turn is MLAProlog, MLA, gating and A2E's first stage;
    the last microbatch's way through the experts and back is paid once per pass."""
    from xds_mpi.projection.paper_table import scenario_inputs

    cfg, m, hw, kwargs = scenario_inputs("000 afd")
    p = project(cfg, m, hw, **kwargs)
    prim = p.primitives_s
    micro = cfg.deployment.num_microbatches
    assert prim["layer"] >= micro * prim["attention side"]
    assert prim["attention side"] > p.parts_s["attention side"]["A2E stage 1"] > 0
    tail = prim["A2E"] - p.parts_s["A2E"]["stage 1"] + prim["MoE"] + prim["E2A"]
    assert prim["tail"] == pytest.approx(tail)
    assert p.breakdown_s["last microbatch's tail"] == pytest.approx(tail)
    mtp_tail = p.parts_s["MTP pass"]["MTP last microbatch's tail"]
    assert mtp_tail > 0
    assert p.breakdown_s["MTP last microbatch's tail"] == pytest.approx(
        mtp_tail * kwargs["mtp_depth"]
    )


def test_h800_traffic_leaving_the_node_sets_the_growth_with_ep():
    """Two tiers: with uniform routing inside / EP of the bytes come over NVLink and the rest
    over the NIC, both at once; more peers outside the node -> slower. The 910C's UB is one
    tier, so its growth comes from the slowest peer only."""
    hw = Hardware.from_profile(load_profile("h800"))
    cost = CostModel(BIG, hw)
    rows = 128 * 8
    nbytes = rows * (7168 + 4)
    for ep in (8, 16, 64, 256):
        inside = min(ep, 8)
        latency = 2 * 3.0e-6 if ep > 8 else 2 * 1.0e-6
        moving = max(nbytes * inside / ep / 160e9, nbytes * (1 - inside / ep) / 50e9)
        expected = hw.dispatch_start_s + latency + moving + hw.jitter_s * expected_max_z(ep)
        assert cost.dispatch(rows, peers=ep) == pytest.approx(expected)
    times = [cost.dispatch(rows, peers=ep) for ep in (8, 16, 32, 64, 128, 256)]
    assert times == sorted(times) and times[-1] / times[0] > 2
    one_tier = CostModel(BIG, replace(hw, node_dies=0))
    assert one_tier.dispatch(rows, peers=8) > cost.dispatch(rows, peers=8)


def test_int8_attention_applies_to_000_only_and_its_bracket_is_the_models():
    """[000] §4.7's INT8 facts on [000]'s scenarios only ([001] states neither); the bracket
    printed beside the table is each moved [000] row projected at none and at all of the
    layers in INT8, recomputed here, and a row the share cannot move (A2E) is left out."""
    from xds_mpi.projection.paper_data import INT8_ATTENTION_000
    from xds_mpi.projection.paper_table import int8_attention_bracket, scenario_inputs

    for name, s in SCENARIOS.items():
        cfg = scenario_inputs(name)[0]
        is_000 = name.startswith("000")
        assert cfg.scheduler.kv_int8 == is_000, name
        assert s.int8_attention == (INT8_ATTENTION_000 if is_000 else 0.0), name
    hw = Hardware.from_profile(load_profile("ascend910c"))
    bracket = int8_attention_bracket()
    assert {r.metric for r, _ in bracket} >= {"forward", "share attention", "attention side"}
    assert "A2E" not in {r.metric for r, _ in bracket}
    by_metric = {(p.source, p.metric): p for p in VALIDATION}
    for row, values in bracket:
        pub = by_metric[(row.source, row.metric)]
        s = SCENARIOS[pub.scenario]
        for share, value in zip((0.0, 1.0), values, strict=True):
            SCENARIOS[pub.scenario] = replace(s, int8_attention=share)
            try:
                assert value == pytest.approx(_recompute(pub, hw), rel=1e-9), (row, share)
            finally:
                SCENARIOS[pub.scenario] = s
        if row.metric == "attention side":  # more layers in INT8: a faster attention side
            assert values[1] < row.projected < values[0]
