"""Load generators from the ecosystem against a live `xds-mpi serve`: aiperf, guidellm and
inference-perf each sweep three concurrency levels (a few hundred streaming requests in all);
their own report must show every request served without error, and the TE-shell's --check at
shutdown must count exactly the requests they sent, with 0 mismatches.

Each is heavy (its own environment, docs/serve.md "Load generators"): each test runs only when
$XDS_AIPERF / $XDS_GUIDELLM / $XDS_INFERENCE_PERF names its executable (the Python beside it
writes the tokenizer directory).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from serve_harness import ROOT, Server

AIPERF = os.environ.get("XDS_AIPERF", "")
GUIDELLM = os.environ.get("XDS_GUIDELLM", "")
INFERENCE_PERF = os.environ.get("XDS_INFERENCE_PERF", "")
CONCURRENCY = (1, 4, 16)
REQUESTS_PER_LEVEL = 80
OUTPUT_TOKENS = 8

pytestmark = pytest.mark.timeout(3600)


def write_tokenizer(tmp: Path, tool: str) -> Path:
    """The byte tokenizer as a Hugging Face directory, written by the Python beside `tool`."""
    tokenizer = tmp / "tokenizer"
    python = Path(tool).with_name("python")
    subprocess.run(
        [str(python), str(ROOT / "tests/loadgen/byte_tokenizer.py"), str(tokenizer)],
        check=True,
        timeout=600,
    )
    return tokenizer


def write_inputs(tmp: Path) -> tuple[Path, Path]:
    """The byte tokenizer as a Hugging Face directory, and a file of prompts."""
    tokenizer = write_tokenizer(tmp, AIPERF)
    prompts = tmp / "prompts.jsonl"
    lines = [json.dumps({"text": f"Prompt {i}: the pod has 384 NPUs."}) for i in range(64)]
    prompts.write_text("\n".join(lines) + "\n")
    return tokenizer, prompts


@pytest.mark.skipif(not AIPERF, reason="set $XDS_AIPERF to aiperf's executable")
def test_aiperf_sweep(tmp_path):
    tokenizer, prompts = write_inputs(tmp_path)
    server = Server(tmp_path, timeout_s=3000)
    try:
        server.wait_ready()
        artifacts = tmp_path / "artifacts"
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        subprocess.run(
            [
                AIPERF,
                "profile",
                *("--model", "xds-tiny", "--url", server.url, "--endpoint-type", "completions"),
                "--streaming",
                *("--request-count", str(REQUESTS_PER_LEVEL)),
                *("--concurrency", ",".join(map(str, CONCURRENCY))),
                *("--input-file", str(prompts), "--custom-dataset-type", "single_turn"),
                *("--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0"),
                *("--tokenizer", str(tokenizer), "--extra-inputs", "ignore_eos:true"),
                *("--artifact-dir", str(artifacts), "--random-seed", "1"),
            ],
            check=True,
            timeout=3000,
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
        )
    finally:
        server.stop()
    total = 0
    for level in CONCURRENCY:
        report = json.loads(
            next(artifacts.glob(f"concurrency_{level}/**/profile_export_aiperf.json")).read_text()
        )
        assert report["error_summary"] == [], report["error_summary"]
        assert report["request_count"]["avg"] == REQUESTS_PER_LEVEL
        assert report["output_sequence_length"]["avg"] == OUTPUT_TOKENS
        ttft, itl = report["time_to_first_token"], report["inter_token_latency"]
        assert 0 < ttft["p50"] <= ttft["p99"] and 0 < itl["p50"] <= itl["p99"]
        total += int(report["request_count"]["avg"])
    num_requests, num_tokens, mismatches = server.check_line()
    assert (num_requests, num_tokens, mismatches) == (total, total * OUTPUT_TOKENS, 0)


@pytest.mark.skipif(not GUIDELLM, reason="set $XDS_GUIDELLM to guidellm's executable")
def test_guidellm_sweep(tmp_path):
    """guidellm's synthetic prompts (counted with the byte tokenizer) at fixed output lengths
    (it sends max_tokens with ignore_eos). It stops a level once REQUESTS_PER_LEVEL requests
    are done; the ones still in flight then are cancelled (their client goes away) and the
    check compares them as prefixes: the check counts every request guidellm created."""
    tokenizer = write_tokenizer(tmp_path, GUIDELLM)
    report = tmp_path / "guidellm.json"
    server = Server(tmp_path, timeout_s=3000)
    try:
        server.wait_ready()
        backend = f"kind=openai_http,target={server.url},model=xds-tiny"
        subprocess.run(
            [
                GUIDELLM,
                "run",
                *("--backend", backend + ",request_format=/v1/completions"),
                *("--profile", "kind=concurrent,streams=1"),
                *("--override", "profile.streams", ",".join(map(str, CONCURRENCY))),
                *("--constraint", f"kind=max_requests,count={REQUESTS_PER_LEVEL}"),
                *("--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}"),
                *("--tokenizer", f"kind=huggingface_auto,model={tokenizer}"),
                *("--output", f"kind=json,path={report}", "--disable-progress"),
            ],
            check=True,
            timeout=3000,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
        )
    finally:
        output = server.stop()
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert [b["config"]["strategy"]["streams"] for b in benchmarks] == list(CONCURRENCY)
    created = 0
    for bench in benchmarks:
        totals, metrics = bench["metrics"]["request_totals"], bench["metrics"]
        assert totals["errored"] == 0 and totals["successful"] >= REQUESTS_PER_LEVEL - 1, totals
        assert metrics["output_token_count"]["successful"]["percentiles"]["p50"] == OUTPUT_TOKENS
        ttft = metrics["time_to_first_token_ms"]["successful"]["percentiles"]
        itl = metrics["inter_token_latency_ms"]["successful"]["percentiles"]
        assert 0 < ttft["p50"] <= ttft["p99"] and 0 < itl["p50"] <= itl["p99"]
        created += bench["scheduler_state"]["created_requests"]
    num_requests, _, mismatches = server.check_line()
    assert (num_requests, mismatches) == (created, 0), output[-3000:]


@pytest.mark.skipif(not INFERENCE_PERF, reason="set $XDS_INFERENCE_PERF to its executable")
def test_inference_perf_sweep(tmp_path):
    """inference-perf's `synthetic` prompts (cut from a text corpus it ships, so they round-trip
    through the byte tokenizer; its `random` token ids do not), one stage per concurrency."""
    tokenizer = write_tokenizer(tmp_path, INFERENCE_PERF)
    reports = tmp_path / "reports"
    stages = [{"concurrency_level": c, "num_requests": REQUESTS_PER_LEVEL} for c in CONCURRENCY]
    lengths = {"input": (16, 48, 32, 4), "output": (OUTPUT_TOKENS,) * 3 + (0,)}
    data = []
    for kind, (low, high, mean, std_dev) in lengths.items():
        prefix = f"--data.{kind}_distribution."
        data += [prefix + "min", str(low), prefix + "max", str(high), prefix + "mean", str(mean)]
        data += [prefix + "std_dev", str(std_dev), prefix + "total_count", str(len(stages) * 100)]
    server = Server(tmp_path, timeout_s=3000)
    try:
        server.wait_ready()
        subprocess.run(
            [
                INFERENCE_PERF,
                *("--server.type", "vllm", "--server.base_url", server.url),
                *("--server.model_name", "xds-tiny", "--server.ignore_eos", "true"),
                *("--api.type", "completion", "--api.streaming", "true"),
                *("--data.type", "synthetic", *data),
                *("--load.type", "concurrent", "--load.stages", json.dumps(stages)),
                *("--tokenizer.pretrained_model_name_or_path", str(tokenizer)),
                *("--storage.local_storage.path", str(reports)),
            ],
            check=True,
            timeout=3000,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
        )
    finally:
        output = server.stop()
    total = 0
    for i, level in enumerate(CONCURRENCY):
        report = json.loads((reports / f"stage_{i}_lifecycle_metrics.json").read_text())
        assert report["load_summary"]["concurrency"] == level
        ok = report["successes"]
        assert report["failures"]["count"] == 0 and ok["count"] == REQUESTS_PER_LEVEL
        assert ok["output_tokens"]["min"] == ok["output_tokens"]["max"] == OUTPUT_TOKENS
        ttft, itl = ok["latency"]["time_to_first_token"], ok["latency"]["inter_token_latency"]
        assert 0 < ttft["median"] <= ttft["p99"] and 0 < itl["median"] <= itl["p99"]
        total += ok["count"]
    num_requests, num_tokens, mismatches = server.check_line()
    assert (num_requests, num_tokens, mismatches) == (total, total * OUTPUT_TOKENS, 0), output
