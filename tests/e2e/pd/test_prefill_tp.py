"""Prefill TP groups (`deployment.prefill_tp`, xds_mpi/execution/prefill_tp.py) and the microbatch
prefill pipeline (`pd.prefill_microbatches`): the head split gives every head's values bit for
bit, the gather area's layout, the refusals before launch, and pd runs with TP=2 and with the
pipeline token-exact against the single-process reference."""

from __future__ import annotations

import subprocess
from functools import partial

import numpy as np
import pytest
from harness import REPO_ROOT
from test_serving import XDS_MPI

from xccl.layout import RECORD_BYTES
from xccl.tp_gather import TpLayout
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.execution.prefill_tp import row_bounds
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.weights import build_model
from xds_mpi.plan.deployment import DeploymentPlan


def _model():
    cfg = load_config(resolve_config("pd"))
    return cfg.model, build_model(cfg.model)


def _batch(model_cfg, rng, lengths):
    """A prefill batch of fresh prompts: rows [n, hidden], positions, chunks on slots 0.."""
    chunks, positions, start = [], [], 0
    for num in lengths:
        chunks.append(AttnChunk(start_pos=0, num_tokens=num, slots=np.arange(start, start + num)))
        positions += list(range(num))
        start += num
    x = rng.standard_normal((start, model_cfg.hidden))
    return x, np.array(positions, np.int64), chunks


def _cache(model_cfg, num_slots):
    return LatentCache(
        num_layers=1,
        num_slots=num_slots,
        kv_lora_rank=model_cfg.kv_lora_rank,
        rope_dim=model_cfg.qk_rope_dim,
        dtype=np.float64,
    )


def _sp_tp_sp(attn, x, positions, chunks, tp, cache):
    """MLA as a TP group of `tp` dies computes it (xds_mpi/execution/prefill_tp.py), every die
    played here in turn: stage 1 on each die's rows, stage 2 on each die's heads over every
    row, stage 3 on each die's rows with every head -> [n, hidden]."""
    bounds = row_bounds(len(x), tp)
    rows = [slice(bounds[i], bounds[i + 1]) for i in range(tp)]
    down = [(attn.q_down(x[r]), *attn.project_latent(x[r], positions[r])) for r in rows]
    q_lora, c_kv, k_rope = (np.concatenate([d[k] for d in down]) for k in range(3))
    per_die = attn.num_heads // tp
    heads = [
        attn.attend_latents(
            q_lora,
            c_kv,
            k_rope,
            positions,
            chunks,
            cache(),
            0,
            slice(i * per_die, (i + 1) * per_die),
        )
        for i in range(tp)
    ]
    return np.concatenate(
        [attn.project_out(np.concatenate([o[r] for o in heads], axis=1)) for r in rows]
    )


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("tp", [2, 4])
def test_sp_tp_sp_is_bit_exact(tp, absorbed):
    """The three stages over the group's dies: the reference's attention output bit for bit,
    at odd and even row counts, several prompts in one batch, fewer rows than dies."""
    model_cfg, model = _model()
    attn = model.layers[1].attn
    if not absorbed:
        attn.use_projections()
    rng = np.random.default_rng(tp)
    for lengths in ([1], [3], [5, 2], [7, 16, 1], [33, 6]):
        x, positions, chunks = _batch(model_cfg, rng, lengths)
        whole = attn(x, positions, chunks, _cache(model_cfg, len(x)), 0)
        split = _sp_tp_sp(attn, x, positions, chunks, tp, partial(_cache, model_cfg, len(x)))
        assert split.tobytes() == whole.tobytes(), (lengths, tp)


def test_row_bounds():
    assert row_bounds(7, 2) == [0, 4, 7]
    assert row_bounds(2, 4) == [0, 1, 2, 2, 2]
    assert row_bounds(0, 4) == [0, 0, 0, 0, 0]


def test_gather_layout_disjoint():
    """Every (parity, writer) record and slot of a member's area is its own, inside the area."""
    layout = TpLayout(members=(6, 7, 8, 9), base=(0,) * 6 + (128,) * 4, slot_bytes=4096)
    spans = []
    for parity in range(2):
        for writer in range(4):
            spans.append((layout.record_offset(7, parity, writer), RECORD_BYTES))
            spans.append((layout.slot_offset(7, parity, writer), 4096))
    spans.sort()
    assert spans[0][0] == 128
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == 128 + layout.area_bytes()


def _plan(*sets: str):
    return DeploymentPlan.build(load_config(resolve_config("pd"), list(sets)))


def test_plan_groups_and_windows():
    plan = _plan("deployment.num_prefill_dies=4", "deployment.dp_groups_per_domain=2",
                 "deployment.prefill_tp=2")  # fmt: skip
    pd = plan.pd
    assert [t.members for t in pd.tp_layouts] == [(4, 5), (6, 7)]
    assert pd.tp_group_of(7) == (6, 7)
    one = _plan("deployment.num_prefill_dies=4", "deployment.dp_groups_per_domain=2")
    for rank in pd.prefill:  # the gather area comes on top of the TP=1 window
        assert plan.window_bytes[rank] == one.window_bytes[rank] + pd.tp_layouts[0].area_bytes()


@pytest.mark.parametrize(
    "sets, message",
    [
        (("deployment.prefill_tp=3",), r"deployment.prefill_tp must be 1, 2 or 4 .* got 3"),
        (("deployment.prefill_tp=0",), r"deployment.prefill_tp must be 1, 2 or 4 .* got 0"),
        (("deployment.prefill_tp=4",),
         r"deployment.prefill_tp\(4\) must divide every prefill TE's dies: "
         r"deployment.num_prefill_dies\(2\) / pd.num_prefill_tes\(1\) gives TEs of \[2\] dies"),
        (("deployment.prefill_tp=2", "pd.num_prefill_tes=2"),
         r"deployment.prefill_tp\(2\) must divide every prefill TE's dies: .* TEs of \[1, 1\]"),
        (("deployment.prefill_tp=4", "deployment.num_prefill_dies=4",
          "deployment.dp_groups_per_domain=2", "model.num_heads=2", "model.weights=random"),
         r"deployment.prefill_tp\(4\) must divide model.num_heads\(2\)"),
        (("deployment.prefill_tp=2", "pd.enabled=false"),
         r"deployment.prefill_tp\(2\) needs pd.enabled"),
        (("pd.prefill_microbatches=3",), r"pd.prefill_microbatches must be 1 or 2 .* got 3"),
    ],
)  # fmt: skip
def test_refusals(sets, message):
    with pytest.raises(ConfigError, match=message):
        _plan(*sets)


def test_refuses_faults_a_tp_group_does_not_handle():
    with pytest.raises(ConfigError, match=r"faults.table\[0\].die\(7\) sends no KV: .* \[6\]"):
        _plan("deployment.prefill_tp=2",
              "faults.table=[{die: 7, op: p2p_send, layer: 0, iteration: 0}]")  # fmt: skip


def test_cli_names_the_key(capsys):
    from launch.cli.main import main

    assert main(["validate", "pd", "--set", "deployment.prefill_tp=4"]) == 2
    assert "deployment.prefill_tp(4) must divide" in capsys.readouterr().err


def test_pipeline_plan_has_two_lanes():
    plan = _plan("pd.prefill_microbatches=2")
    one = _plan()
    assert plan.pd.eps[0].num_lanes == 2
    area = one.pd.eps[0].area_bytes()
    assert plan.window_bytes[6] == one.window_bytes[6] + area  # a second dispatch/combine area


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sets", [("deployment.prefill_tp=2",), ("deployment.prefill_tp=2", "pd.prefill_microbatches=2")]
)
def test_run_is_token_exact(tmp_path, sets):
    """`xds-mpi run pd --check` with one prefill DP group of 2 dies, without and with the
    two-microbatch prefill pipeline: every token the reference's, and only the group's leader
    sends KV."""
    extra = [arg for s in sets for arg in ("--set", s)]
    result = subprocess.run(
        [str(XDS_MPI), "run", "pd", "--check", "--set", f"run.output_dir={tmp_path}",
         "--set", "run.name=pd", "--set", "run.trace=false",
         "--set", "workload.num_requests=4", *extra],
        capture_output=True, text=True, timeout=280, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check: 4 requests" in result.stdout and " 0 mismatches" in result.stdout, (
        result.stdout + result.stderr
    )
    import h5py

    with h5py.File(tmp_path / "pd.h5", "r") as f:
        senders = set(f["pd"]["prefill_rank"][()].tolist())
    assert senders == {6}  # the TP group's leader
