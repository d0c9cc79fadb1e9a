"""Trace replay (`workload.source: trace`, docs/trace.md): a crafted Mooncake trace whose shared
prefixes and bad lines are known exactly, the Azure format, the window, the prefix-reuse
accounting, the SLO goodput, and one PD run of the crafted trace with `--check`; the shared
conversation trace when ../shared holds it."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT
from test_serving import XDS_MPI, check_line

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.kv_memory import projected_kv_bytes
from xds_mpi.results.request_pricing import RequestPricer, planes
from xds_mpi.results.slo import RequestTimes, slo_summary
from xds_mpi.workload.requests import Request, rejection
from xds_mpi.workload.trace_replay import hit_blocks, prefix_hits, trace_requests

SHARED_TRACE = REPO_ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
SCALE = 1 / 64  # 512-token blocks -> 8 served tokens


def line(ts, n_in, n_out, ids) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
    )


# The crafted trace: (text, reason fragment or "" when served). Blocks of 512 tokens.
CRAFTED = [
    (line(0, 1024, 64, [1, 2]), ""),  # 2 blocks
    (line(1000, 1500, 128, [1, 2, 3]), ""),  # shares blocks 1, 2 with the first
    ("", "blank line"),
    ('{"timestamp": 1200, "input_length": 10', "not JSON"),
    ('{"timestamp": 1300, "input_length": 100, "hash_ids": [9]}', "'output_length' missing"),
    (line(500, 512, 64, [7]), "timestamp 0.5 s before the line above's 1 s"),
    (line(-5, 512, 64, [7]), "negative timestamp"),
    (line(1400, 1500, 64, [1, 2]), "2 hash_ids for input_length(1500)"),
    (line(1500, 512 * 40, 64, list(range(100, 140))), "> a die's KV capacity (256 tokens)"),
    (line(2000, 900, 64, [1, 4]), ""),  # shares block 1 only
    (line(3000, 700, 320, [5, 6]), ""),  # shares nothing
    ('["not", "an", "object"]', "not a JSON object"),
]


def crafted_cfg(tmp_path: Path, *sets: str):
    path = tmp_path / "crafted.jsonl"
    path.write_text("\n".join(text for text, _ in CRAFTED) + "\n")
    return load_config(
        REPO_ROOT / "configs" / "pd.yaml",
        [
            "workload.source=trace",
            f"trace.path={path}",
            f"trace.length_scale={SCALE}",
            "trace.output_scale=0.0625",
            "trace.speedup=4",
            "scheduler.num_kv_blocks_per_die=16",
            *sets,
        ],
    )


def test_crafted_trace_tokens_and_rejections(tmp_path):
    cfg = crafted_cfg(tmp_path)
    reqs = trace_requests(cfg)
    assert len(reqs) == len(CRAFTED)
    for req, (_, reason) in zip(reqs, CRAFTED):
        got = rejection(req, cfg)
        if reason:  # the line number (1-based) and the reason
            assert got.startswith(f"crafted.jsonl line {req.req_id + 1}: "), got
            assert reason in got, got
        else:
            assert got == "", got
    served = {r.trace_line: r for r in reqs if not rejection(r, cfg)}
    assert sorted(served) == [1, 2, 10, 11]
    b = 8  # served tokens per 512-token block at SCALE
    a, c, d, e = served[1].prompt, served[2].prompt, served[10].prompt, served[11].prompt
    assert (len(a), len(c), len(d), len(e)) == (16, 23, 14, 11)  # round(len / 64)
    assert c[: 2 * b] == a  # ids [1, 2] shared: 16 equal tokens
    assert c[2 * b : 3 * b] != a[b:]  # id 3 is not id 2
    assert d[:b] == a[:b] and d[b:] != a[b : 2 * b][: len(d) - b]  # id 1 shared, id 4 not
    assert e[:b] != a[:b]
    # lengths: served scaled, the trace's kept for the projection; arrivals / speedup
    assert (served[2].max_new_tokens, served[2].trace_prompt_len) == (8, 1500)
    assert served[2].trace_output_len == 128 and served[2].priced_prompt_len == 1500
    assert [served[k].arrival_s for k in (1, 2, 10, 11)] == [0.0, 0.25, 0.5, 0.75]
    # the model's length is a cap too
    short_cfg = crafted_cfg(tmp_path, "model.max_seq_len=24")
    reason = rejection(trace_requests(short_cfg)[1], short_cfg)
    assert reason == (
        "crafted.jsonl line 2: served prompt(23) + output(8) + mtp_depth(0) = 31 > "
        "model.max_seq_len(24)"
    )
    # seeded: the same seed gives the same tokens, another seed others
    again = trace_requests(cfg)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = trace_requests(crafted_cfg(tmp_path, "workload.seed=1"))
    assert other[0].prompt != reqs[0].prompt


def test_prefix_hits_of_the_crafted_trace(tmp_path):
    cfg = crafted_cfg(tmp_path)
    served = [r for r in trace_requests(cfg) if not rejection(r, cfg)]
    assert hit_blocks(served) == {0: 0, 1: 2, 9: 1, 10: 0}
    hits = prefix_hits(served, 512)
    # blocks 2 + 3 + 2 + 2; hits: line 2 reuses [1, 2], line 10 reuses [1]
    assert (hits.num_blocks, hits.num_hit_blocks) == (9, 3)
    assert hits.prompt_tokens == 1024 + 1500 + 900 + 700
    assert hits.hit_tokens == 2 * 512 + 512
    # a chain, not a set: block 2 after a different first block is no hit
    moved = [Request(req_id=0, prompt=(1,), max_new_tokens=1, trace_prompt_len=1024,
                     block_ids=(1, 2)),
             Request(req_id=1, prompt=(1,), max_new_tokens=1, trace_prompt_len=1024,
                     block_ids=(3, 2), arrival_s=1.0)]  # fmt: skip
    assert prefix_hits(moved, 512).num_hit_blocks == 0
    # the whole prompt cached: its last token is still computed
    same = [Request(req_id=i, prompt=(1,), max_new_tokens=1, trace_prompt_len=1024,
                    block_ids=(1, 2), arrival_s=float(i)) for i in range(2)]  # fmt: skip
    assert prefix_hits(same, 512).hit_tokens == 1023


def test_window_and_max_requests(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(line(1000 * i, 512, 8, [i]) for i in range(10)) + "\n")
    base = ["workload.source=trace", f"trace.path={path}", "trace.length_scale=0.05"]
    window = ["trace.start_s=3", "trace.duration_s=4", "trace.speedup=2"]
    cfg = load_config(REPO_ROOT / "configs" / "pd.yaml", [*base, *window])
    reqs = trace_requests(cfg)
    assert [r.trace_line for r in reqs] == [4, 5, 6, 7]  # t = 3, 4, 5, 6 s
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5]
    cfg = load_config(REPO_ROOT / "configs" / "pd.yaml", [*base, "trace.max_requests=3"])
    assert [r.trace_line for r in trace_requests(cfg)] == [1, 2, 3]


def test_azure_format(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.5,x,3\n"
        "2023-11-16 18:15:52.0,100\n"
        "2023-11-16 18:15:53.0,880,0\n"
    )
    cfg = load_config(
        REPO_ROOT / "configs" / "pd.yaml",
        ["workload.source=trace", f"trace.path={path}", "trace.format=azure",
         "trace.length_scale=0.1"],
    )  # fmt: skip
    reqs = trace_requests(cfg)
    reasons = [rejection(r, cfg) for r in reqs]
    assert reasons[:2] == ["", ""]
    assert reasons[2] == "azure.csv line 4: ContextTokens must be an integer, got 'x'"
    assert reasons[3].startswith("azure.csv line 5: 2 fields, 3 expected")
    assert reasons[4] == "azure.csv line 6: GeneratedTokens(0) must be >= 1"
    assert math.isclose(reqs[1].arrival_s, 4.314579, abs_tol=1e-6)
    assert (len(reqs[0].prompt), reqs[0].trace_prompt_len, reqs[0].max_new_tokens) == (37, 374, 4)
    assert reqs[0].prompt != reqs[1].prompt[:37]  # Azure prompts share nothing


def test_trace_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"trace.length_scale\(2.0\) .* must be <= 1"):
        load_config(REPO_ROOT / "configs" / "pd.yaml", ["trace.length_scale=2"])
    with pytest.raises(ConfigError, match="trace.speedup must be > 0, got 0"):
        load_config(REPO_ROOT / "configs" / "pd.yaml", ["trace.speedup=0"])
    cfg = load_config(REPO_ROOT / "configs" / "pd.yaml", ["workload.source=trace"])
    with pytest.raises(ConfigError, match="trace.path must name a trace file"):
        trace_requests(cfg)
    cfg = load_config(
        REPO_ROOT / "configs" / "pd.yaml",
        ["workload.source=trace", f"trace.path={tmp_path / 'none.jsonl'}"],
    )
    with pytest.raises(ConfigError, match="none.jsonl"):
        trace_requests(cfg)


def test_projection_prices_the_trace_lengths(tmp_path):
    cfg = crafted_cfg(tmp_path)
    pricer = RequestPricer(cfg, num_prefill_dies=2, num_decode_dies=4, batch_per_die=4, is_pd=True)
    short = Request(req_id=0, prompt=(1,) * 16, max_new_tokens=4)
    long = Request(req_id=1, prompt=(1,) * 16, max_new_tokens=4, trace_prompt_len=16_000,
                   trace_output_len=400)  # fmt: skip
    a, b = pricer.price(short), pricer.price(long)
    assert b.prefill_s > 10 * a.prefill_s  # the same served prompt, priced at 16k tokens
    assert b.transfer_s > a.transfer_s > 0 and b.step_s > a.step_s
    ub = planes(load_profile("ascend910c"))["UB"]
    cached = pricer.price(long, 8000, ub)  # half the prompt pulled from a pool over UB
    assert cached.prefill_s < 0.75 * b.prefill_s and cached.step_s == b.step_s
    assert cached.pull_s == pytest.approx(ub.pull_s(projected_kv_bytes(8000, cost_shape())))
    assert cached.ttft_s == pytest.approx(
        cached.pull_s + cached.prefill_s + b.transfer_s + b.step_s
    )
    colocated = RequestPricer(cfg, num_prefill_dies=4, num_decode_dies=4, batch_per_die=4,
                              is_pd=False)  # fmt: skip
    assert colocated.price(long).transfer_s == 0.0


def test_goodput_counts_both_slos():
    cfg = load_config(REPO_ROOT / "configs" / "pd.yaml", ["run.slo_tpot_ms=30"])
    times = [
        RequestTimes(req_id=0, ttft_s=9.0, tpot_s=0.5, ttft_v_s=1.5, tpot_v_s=0.020),  # meets
        RequestTimes(req_id=1, ttft_s=0.1, tpot_s=0.01, ttft_v_s=2.5, tpot_v_s=0.020),  # TTFT
        RequestTimes(req_id=2, ttft_s=0.1, tpot_s=0.01, ttft_v_s=1.0, tpot_v_s=0.031),  # TPOT
        RequestTimes(req_id=3, ttft_s=0.1, tpot_s=np.nan, ttft_v_s=1.0, tpot_v_s=np.nan),  # 1 tok
    ]
    s = slo_summary(cfg, times)
    assert (s["goodput_requests"], s["goodput_fraction"]) == (2, 0.5)
    assert s["goodput_wall_requests"] == 3
    assert s["projected_ttft_ms_p50"] == pytest.approx(1250.0)
    assert s["projected_tpot_ms_p50"] == pytest.approx(20.0)


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"{SHARED_TRACE} absent (a data file)")
def test_shared_conversation_trace_window():
    cfg = load_config(
        REPO_ROOT / "configs" / "pd.yaml",
        ["workload.source=trace", f"trace.path={SHARED_TRACE}", "trace.start_s=600",
         "trace.duration_s=60", "trace.length_scale=0.004", "trace.speedup=2"],
    )  # fmt: skip
    reqs = trace_requests(cfg)
    assert 150 < len(reqs) < 300  # ~3.3 requests/s over the hour
    assert not any(rejection(r, cfg) for r in reqs)
    assert max(r.arrival_s for r in reqs) < 30.0
    hits = prefix_hits(reqs, 512)
    assert 0 < hits.num_hit_blocks < hits.num_blocks


def test_pd_serves_the_crafted_trace(tmp_path):
    """The crafted trace on configs/pd.yaml with --check: the good lines served and equal to
    the reference, the bad ones rejected with their line and reason in the run file."""
    path = tmp_path / "crafted.jsonl"
    path.write_text("\n".join(text for text, _ in CRAFTED) + "\n")
    sets = ["workload.source=trace", f"trace.path={path}", f"trace.length_scale={SCALE}",
            "trace.output_scale=0.0625", "trace.speedup=4", "scheduler.num_kv_blocks_per_die=16",
            f"run.output_dir={tmp_path}", "run.name=crafted"]  # fmt: skip
    result = subprocess.run(
        [str(XDS_MPI), "run", "pd", "--check", *[a for s in sets for a in ("--set", s)]],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert check_line(result).startswith("check: 4 requests, ")
    assert check_line(result).endswith(" 0 mismatches")
    with h5py.File(tmp_path / "crafted.h5", "r") as f:
        status = [s.decode() for s in f["requests/status"][()]]
        reasons = [s.decode() for s in f["requests/reason"][()]]
        summary = dict(f["summary"].attrs)
        assert sorted(f["slo/req_id"][()]) == [0, 1, 9, 10]
        assert (f["slo/ttft_v_s"][()] > 0).all()
        # the hits (line 2: 2 blocks, line 10: 1) priced as pulled: those two faster, not others
        saved = f["slo/ttft_v_s"][()] - f["slo/cache_ttft_v_s"][()]
        assert (saved[[1, 2]] > 0).all() and (saved[[0, 3]] == 0).all()
    for i, (_, reason) in enumerate(CRAFTED):
        assert status[i] == ("rejected" if reason else "done")
        assert reason in reasons[i] and (not reason or f"line {i + 1}:" in reasons[i])
    assert (summary["trace_lines"], summary["trace_rejected"]) == (12, 8)
    assert (summary["trace_blocks"], summary["trace_prefix_hit_blocks"]) == (9, 3)
    assert summary["trace_prompt_tokens"] == 1024 + 1500 + 900 + 700
    assert 0 <= summary["goodput_requests"] <= summary["cache_goodput_requests"] <= 4
    assert summary["cache_projected_ttft_ms_p50"] <= summary["projected_ttft_ms_p50"]
