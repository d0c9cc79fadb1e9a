"""The default profile prices exactly as before issue 61: its mechanisms (shape-aware GEMMs,
per-kernel fixed costs, the straggler tail) are opt-in (configs/hardware/ascend910c_kernels.yaml,
docs/projection.md), so ascend910c.yaml takes cost.py's flat path.

`default_prices.json` beside this file holds the prices of main's model before the merge of issue
61 (main at 798c3a0), for the cases below: colocated (EP288, with MTP and a hot expert die), the
two-stream overlap, AFD, a prefill's operations, and the emulated dies' small model. It was
written by this file run with that commit's package first on the path:

    git worktree add /tmp/main-798c3a0 798c3a0
    PYTHONPATH=/tmp/main-798c3a0 python tests/unit/xds_mpi/projection/test_default_pricing.py \\
        --write tests/unit/xds_mpi/projection/default_prices.json

(`prices()` imports nothing issue 61 added, so it runs on either model.) The test compares every
price with == (not approx): the same formulas in the same order give the same floats. The one
change is the per-chip count (issue 61's fix: tokens/s per chip divide by the profile's dies per
chip, not the emulated pod's); the 910C's is 2 either way, so tokens/s per chip is equal too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIXTURE = Path(__file__).with_name("default_prices.json")
# primitives issue 61 added beside the old ones (a wait's compute-imbalance part, read by the
# slowest-call rows of the paper table): printed, not priced into anything
NEW_PRIMITIVES = {"dispatch imbalance", "combine imbalance"}

CASES = {
    # name: (config, project() keywords; "moe": Imbalance(moe=...), "microbatches": Execution)
    "colocated ep288": ("ep288", dict(batch_per_die=60, kv_len=3072)),
    "colocated ep288 mtp hot": (
        "ep288",
        dict(batch_per_die=60, kv_len=3072, mtp_depth=1, accept_rate=0.9, moe=2.0),
    ),
    "colocated ep288 int8 attention": (
        "ep288",
        dict(batch_per_die=24, kv_len=2048, mtp_depth=1, accept_rate=0.9, int8_attention=0.5),
    ),
    "two-stream ep288 b96": (
        "ep288",
        dict(batch_per_die=96, kv_len=4096, mtp_depth=1, accept_rate=0.9, microbatches=2),
    ),
    "two-stream ep288 b64 split 16": (
        "ep288",
        dict(batch_per_die=64, kv_len=4096, microbatches=2, stream0_aic=16),
    ),
    "colocated small": ("colocated", dict(batch_per_die=8, kv_len=512)),
    "afd pod": ("afd_pod", dict(batch_per_die=96, kv_len=2048, mtp_depth=1, accept_rate=0.9)),
    "afd small": ("afd", dict(batch_per_die=4, kv_len=256)),
}


def prices() -> dict:
    """Every case's projection and a prefill's and a decode's operations, on the default profile
    of whichever model is first on the path."""
    import xds_mpi
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.config.schema import ModelConfig, load_config
    from xds_mpi.model.shapes import cost_shape
    from xds_mpi.projection.cost import CostModel, Hardware
    from xds_mpi.projection.imbalance import Imbalance
    from xds_mpi.projection.project import Execution, project

    repo = Path(xds_mpi.__file__).resolve().parents[1]
    hw = Hardware.from_profile(load_profile("ascend910c"))
    out: dict = {}
    for name, (config, kw) in CASES.items():
        kw = dict(kw)
        extra = {}
        if "moe" in kw:
            extra["imbalance"] = Imbalance(moe=kw.pop("moe"))
        if "microbatches" in kw:
            split = kw.pop("stream0_aic", None)
            extra["execution"] = Execution(microbatches=kw.pop("microbatches"), stream0_aic=split)
        cfg = load_config(repo / "configs" / f"{config}.yaml")
        p = project(cfg, cost_shape(), hw, **kw, **extra)
        out[name] = dict(
            iteration_s=p.iteration_s,
            tpot_s=p.tpot_s,
            tokens_per_s_per_chip=p.tokens_per_s_per_chip,
            breakdown_s=p.breakdown_s,
            primitives_s=p.primitives_s,
            parts_s=p.parts_s,
        )
    for shape_name, shape in (("DeepSeek-V3", cost_shape()), ("emulated", ModelConfig())):
        for kv_int8 in (False, True):
            cost = CostModel(shape, hw, kv_int8=kv_int8)
            ops = {}
            for rows in (0, 1, 8, 60, 120, 4096):  # decode batches and a prefill chunk
                ops[f"gemm {rows}"] = cost.gemm(rows, 7168 * 2048)
                ops[f"bf16_gemm {rows}"] = cost.bf16_gemm(rows, 7168 * 2048)
                ops[f"mla_prolog {rows}"] = cost.mla_prolog(rows)
                ops[f"gate {rows}"] = cost.gate(rows)
                ops[f"experts {rows}"] = cost.experts([rows, rows / 3])
                ops[f"routed {rows}"] = cost.routed(rows * 8, 8)
                ops[f"dense_ffn {rows}"] = cost.dense_ffn(rows)
                ops[f"mtp_projection {rows}"] = cost.mtp_projection(rows)
                ops[f"head {rows}"] = cost.head(rows)
                ops[f"sampling {rows}"] = cost.sampling(rows)
                ops[f"dispatch {rows}"] = cost.dispatch(rows, peers=288, int8=True)
                ops[f"combine {rows}"] = cost.combine(rows, peers=288)
            # decode (one row per sequence, long KV) and prefill (a 2K prompt, its own rows)
            ops["attention decode"] = cost.attention([(3072, 1)] * 60)
            ops["attention decode mtp"] = cost.attention([(4096, 2)] * 96)
            ops["attention prefill"] = cost.attention([(2048, 2048)])
            ops["attention prefill chunked"] = cost.attention([(4096, 1024), (512, 512)])
            out[f"ops {shape_name} kv_int8={kv_int8}"] = ops
    return out


def test_the_default_profile_takes_the_flat_path():
    """ascend910c.yaml has no `operators`, `kernels` or `stragglers` section: no kernel costs, no
    fixed cost, no tail; the opt-in profile has all three."""
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.model.shapes import cost_shape
    from xds_mpi.projection.cost import CostModel, Hardware

    default = load_profile("ascend910c")
    assert not {"operators", "kernels", "stragglers"} & set(default)
    hw = Hardware.from_profile(default)
    assert (hw.ops, hw.kernels, hw.tail) == (None, {}, None)
    cost = CostModel(cost_shape(), hw)
    assert not cost.shaped and cost.fixed("experts") == 0.0
    # the flat path's GEMM is the one roofline: max(INT8 FLOPs at 80 %, weight bytes at 84.1 %)
    for rows in (1, 60, 4096):
        assert cost.gemm(rows, 7168 * 2048) == max(
            2.0 * rows * 7168 * 2048 / (752e12 * 0.80), 7168 * 2048 * 1 / (1.6e12 * 0.841)
        )
    kernels = Hardware.from_profile(load_profile("ascend910c_kernels"))
    assert kernels.ops is not None and kernels.kernels and kernels.dies_per_chip == 2
    assert CostModel(cost_shape(), kernels).shaped


def test_the_default_profile_prices_as_main_did():
    """Every price of `prices()` on the landed model equals main's (default_prices.json)."""
    before = json.loads(FIXTURE.read_text())
    now = prices()
    for case, values in before.items():
        mine = now[case]
        if "primitives_s" in values:
            assert set(mine["primitives_s"]) - set(values["primitives_s"]) <= NEW_PRIMITIVES
            mine = {**mine, "primitives_s": {k: mine["primitives_s"][k]
                                             for k in values["primitives_s"]}}  # fmt: skip
        assert json.loads(json.dumps(mine)) == values, case


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} --write FILE (with the model to record first on the path)")
    import xds_mpi

    print(f"prices of {xds_mpi.__file__}")
    Path(sys.argv[2]).write_text(json.dumps(prices(), indent=1, sort_keys=True) + "\n")
