"""A load generator from the ecosystem against a live `xds-mpi serve`: aiperf sweeps three
concurrency levels (a few hundred streaming requests in all); its own report must show every
request served without error, and the TE-shell's --check at shutdown must count exactly the
requests aiperf sent, with 0 mismatches.

aiperf is heavy (its own environment, docs/serve.md "Load generators"): this runs only when
$XDS_AIPERF names its executable (the Python beside it writes the tokenizer directory).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from serve_harness import ROOT, Server

AIPERF = os.environ.get("XDS_AIPERF", "")
CONCURRENCY = (1, 4, 16)
REQUESTS_PER_LEVEL = 80
OUTPUT_TOKENS = 8

pytestmark = [
    pytest.mark.timeout(3600),
    pytest.mark.skipif(not AIPERF, reason="set $XDS_AIPERF to aiperf's executable"),
]


def write_inputs(tmp: Path) -> tuple[Path, Path]:
    """The byte tokenizer as a Hugging Face directory, and a file of prompts."""
    tokenizer = tmp / "tokenizer"
    python = Path(AIPERF).with_name("python")
    subprocess.run(
        [str(python), str(ROOT / "tests/loadgen/byte_tokenizer.py"), str(tokenizer)],
        check=True,
        timeout=600,
    )
    prompts = tmp / "prompts.jsonl"
    lines = [json.dumps({"text": f"Prompt {i}: the pod has 384 NPUs."}) for i in range(64)]
    prompts.write_text("\n".join(lines) + "\n")
    return tokenizer, prompts


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
