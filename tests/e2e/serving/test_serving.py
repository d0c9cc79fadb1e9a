"""Colocated decode end to end: `xds-mpi run --check` equals the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from harness import REPO_ROOT

XDS_MPI = Path(sys.executable).parent / "xds-mpi"
# ignore_eos: exact token counts whatever the weights (the reference runs with it too)
SMALL = [
    "--set",
    "workload.num_requests=6",
    "--set",
    "workload.output_len=6",
    "--set",
    "workload.prompt_len=12",
    "--set",
    "workload.ignore_eos=true",
]


def serve(
    tmp_path: Path, *args: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess, h5py.File | None]:
    result = subprocess.run(
        [
            str(XDS_MPI),
            "run",
            "colocated",
            "--check",
            "--set",
            f"run.output_dir={tmp_path}",
            "--set",
            "run.name=serve",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )
    path = tmp_path / "serve.h5"
    return result, (h5py.File(path, "r") if path.exists() else None)


def check_line(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("check:")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    return lines[-1]


@pytest.mark.parametrize("num_dies", [2, 4, 8])
def test_every_token_equals_the_reference(tmp_path, num_dies):
    result, run_file = serve(
        tmp_path, *SMALL, "--set", f"deployment.dp_groups_per_domain={num_dies}"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 6 requests, 36 tokens, 0 mismatches"
    assert "summary: 6 requests served, 0 rejected, 36 tokens" in result.stdout
    assert list(run_file["requests/status"].asstr()[()]) == ["done"] * 6
    assert run_file["summary"].attrs["check_mismatches"] == 0
    assert sorted(run_file["dies"]) == [str(r) for r in range(1, num_dies + 1)]


def test_continuous_batching_with_more_requests_than_slots_int8_off_random_weights(tmp_path):
    # 2 dies x 2 batch slots for 10 requests; prompts in chunks of 5; one die sees 1 request
    # at the end while the other is idle; dispatch rows in float64 (no INT8); seeded weights.
    result, run_file = serve(
        tmp_path,
        "--set",
        "deployment.dp_groups_per_domain=2",
        "--set",
        "model.weights=random",
        "--set",
        "workload.ignore_eos=true",
        "--set",
        "scheduler.max_batch_per_die=2",
        "--set",
        "scheduler.prefill_chunk_tokens=5",
        "--set",
        "xccl.use_int8=false",
        "--set",
        "workload.num_requests=10",
        "--set",
        "workload.output_len=4",
        "--set",
        "workload.prompt_len=12",
        "--set",
        "workload.length_dist=uniform",
        "--set",
        "workload.max_prompt_len=20",
        "--set",
        "workload.max_output_len=4",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 10 requests, 40 tokens, 0 mismatches"
    # At most 2 requests at once on a die, each with at most a 5-token prompt chunk per iteration,
    # yet each die served more requests than it has slots: they joined as others left.
    for die in ("1", "2"):
        assert run_file[f"dies/{die}/num_rows"][()].max() <= 2 * 5
    served_by = list(run_file["requests/die_rank"][()])
    assert served_by.count(1) > 2 and served_by.count(2) > 2


def test_bad_requests_are_rejected_with_reasons_and_the_good_ones_served(tmp_path):
    lines = [
        json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 5}),
        json.dumps({"prompt": ""}),  # text prompts start with BOS
        json.dumps({"prompt_ids": [], "max_tokens": 3}),
        json.dumps({"prompt_ids": [1, 2, 999], "max_tokens": 3}),
        json.dumps({"prompt_ids": [1, 2, 3], "max_tokens": 0}),
        json.dumps({"prompt_ids": [5] * 4000, "max_tokens": 200}),
        "{not json",
        json.dumps({"prompt_ids": [7, 8, 9, 10], "max_tokens": 4}),
    ]
    workload = tmp_path / "requests.jsonl"
    workload.write_text("\n".join(lines) + "\n")
    result, run_file = serve(
        tmp_path, "--set", "workload.source=jsonl", "--set", f"workload.path={workload}"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = list(run_file["requests/status"].asstr()[()])
    reasons = list(run_file["requests/reason"].asstr()[()])
    assert status == [
        "done",
        "done",
        "rejected",
        "rejected",
        "rejected",
        "rejected",
        "rejected",
        "done",
    ]
    assert reasons[2] == "empty prompt"
    assert reasons[3] == "token id 999 outside the vocabulary [0, 260)"
    assert reasons[4] == "max_new_tokens(0) < 1"
    assert reasons[5].startswith("prompt(4000) + max_new_tokens(200) = 4200 > model.max_seq_len")
    assert reasons[6].startswith("requests.jsonl line 7: cannot read request")
    assert "request 2 rejected: empty prompt" in result.stdout
    assert check_line(result).startswith("check: 3 requests,")
    assert check_line(result).endswith(" 0 mismatches")


def test_a_workload_nobody_can_serve_is_refused_before_launch(tmp_path):
    result, run_file = serve(
        tmp_path, "--set", "workload.prompt_len=5000", "--set", "workload.max_prompt_len=5000"
    )
    assert result.returncode == 2 and run_file is None
    assert "none of the 8 requests can be served; the first: prompt(5000)" in result.stderr
    assert "launching" not in result.stdout


def test_the_check_reports_a_token_that_differs():
    from xds_mpi.config.schema import config_from_dict
    from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
    from xds_mpi.model.weights import build_model
    from xds_mpi.results.results import RequestRecord, check_against_reference
    from xds_mpi.workload.requests import Request

    cfg = config_from_dict({})
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    outs = ReferenceGenerator(
        build_model(cfg.model), GenerateOptions(max_new_tokens=3, use_int8=True)
    ).generate(prompts)
    records = {
        i: RequestRecord(
            req=Request(req_id=i, prompt=tuple(p), max_new_tokens=3), tokens=list(o.tokens)
        )
        for i, (p, o) in enumerate(zip(prompts, outs))
    }
    assert check_against_reference(cfg, records)[2] == []
    records[1].tokens[1] = (records[1].tokens[1] + 1) % 256
    num_requests, num_tokens, mismatches = check_against_reference(cfg, records)
    assert (num_requests, num_tokens) == (2, 6)
    assert mismatches == ["request 1: token 1 differs (3 tokens served, 3 in the reference)"]


def reference_acceptance(
    overrides: list[str], depth: int, config: str = "colocated"
) -> tuple[int, int]:
    """(drafted, accepted) of the single-process reference's MTP loop on the run's workload."""
    from xds_mpi.config.schema import load_config
    from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
    from xds_mpi.model.weights import build_model
    from xds_mpi.workload.stream import load_workload

    cfg = load_config(REPO_ROOT / "configs" / f"{config}.yaml", overrides)
    requests = load_workload(cfg)
    [max_new] = {r.max_new_tokens for r in requests}
    options = GenerateOptions(
        max_new_tokens=max_new,
        mtp_depth=depth,
        use_int8=cfg.xccl.use_int8,
        ignore_eos=cfg.workload.ignore_eos,
        block_tokens=cfg.scheduler.kv_block_tokens,
    )
    outputs = ReferenceGenerator(build_model(cfg.model), options).generate(
        [list(r.prompt) for r in requests]
    )
    return sum(o.num_drafted for o in outputs), sum(o.num_accepted for o in outputs)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_serves_the_greedy_tokens_and_drafts_what_the_reference_drafts(tmp_path, depth):
    # The trained checkpoint, prompts in chunks of 7 (the MTP modules catch up chunk by chunk),
    # 2 requests per die at a time; --check compares with plain greedy decoding.
    overrides = [
        f"scheduler.mtp_depth={depth}",
        "scheduler.prefill_chunk_tokens=7",
        "scheduler.max_batch_per_die=2",
        "workload.num_requests=10",
    ]
    result, run_file = serve(tmp_path, *[a for s in overrides for a in ("--set", s)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 10 requests, 160 tokens, 0 mismatches"
    summary = run_file["summary"].attrs
    drafted, accepted = reference_acceptance(overrides, depth)
    assert (summary["mtp_drafted"], summary["mtp_accepted"]) == (drafted, accepted)
    assert 0 < summary["mtp_acceptance"] < 1 and summary["tokens_per_step"] > 1
    assert f"MTP depth {depth}: acceptance" in result.stdout
    dies = run_file["dies"]
    assert sum(dies[r]["num_accepted"][()].sum() for r in dies) == accepted
    assert len(summary["mtp_group_acceptance"]) == 4
