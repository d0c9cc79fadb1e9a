"""`xds-mpi serve` on the other decode paths: afd (attention and expert dies) and colocated with
MTP depth 2. A request a stop string ends early is dropped on its die, and --check compares
its tokens and MTP steps with the reference's first ones."""

from __future__ import annotations

import pytest
from serve_harness import Server

MODEL = "xds-tiny"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "args", [("afd",), ("--set", "scheduler.mtp_depth=2")], ids=["afd", "colocated-mtp2"]
)
def test_serve_and_check(tmp_path, args):
    server = Server(tmp_path, *args, timeout_s=400)
    try:
        server.wait_ready()
        body = {"model": MODEL, "prompt": "the pod", "max_tokens": 40, "ignore_eos": True}
        status, whole = server.post("/v1/completions", body)
        assert status == 200, whole
        text = whole["choices"][0]["text"]
        stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
        status, cut = server.post("/v1/completions", {**body, "stop": stop})
        assert status == 200 and cut["choices"][0]["text"] == text[: text.index(stop)]
        for i in range(4):
            prompt = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 8 + i}
            assert server.post("/v1/completions", prompt)[0] == 200
    finally:
        output = server.stop()
    assert server.proc.returncode == 0, output[-3000:]
    assert server.check_line()[0::2] == (6, 0)
    assert "1 of them ended early, compared as prefixes" in output
    assert "the dies dropped 1 of them" in output
