"""`xds-mpi serve pd`: the OpenAI endpoint on the JE of a PD deployment (configs/pd.yaml: 2
prefill dies, 4 decode dies behind the decode TE-shell). Requests go through the JE's routing to
a prefill die, their KV to a decode die, and their tokens stream back as the decode die emits
them. The last test shuts the server down and checks every request against the reference, and
each response's `xds` field against the run file's /pd group.

The tests share the server and run in file order; each one adds what it learned to SEEN.
"""

from __future__ import annotations

import http.client
import json
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import openai
import pytest
from serve_harness import ROOT, Server

pytestmark = pytest.mark.timeout(600)

MODEL = "xds-tiny"
DECODE = (2, 3, 4, 5)  # configs/pd.yaml: ranks 0-1 host (JE, decode TE-shell), 2-5 decode
PREFILL = (6, 7)
SEEN = {"requests": 0, "xds": {}, "disconnected": []}  # xds: req_id -> the response's field


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve_pd"), "pd", timeout_s=500)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def served(xds: dict, n: int = 1) -> None:
    """Count `n` requests the server took; keep `xds` (the one with a response) for the end."""
    SEEN["requests"] += n
    if xds:
        SEEN["xds"][xds["req_id"]] = xds
        assert xds["die_rank"] in DECODE and xds["dp_group"] == DECODE.index(xds["die_rank"])
        assert xds["prefill_die_rank"] in PREFILL
        assert xds["prefill_dp_group"] == PREFILL.index(xds["prefill_die_rank"])
        assert xds["projected_ttft_ms"] > 0 and xds["projected_tpot_ms"] > 0


def test_health_and_models(server, client):
    assert server.get("/health") == (200, '{"status": "ok"}')
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_streamed_and_whole_agree(client):
    args = {"model": MODEL, "prompt": "The pod", "max_tokens": 24}
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    served(whole.model_extra["xds"])
    served(chunks[-1].model_extra["xds"])
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    # the tokens stream as the decode die emits them: one event per token batch, not one in all
    assert len([t for t in texts if t]) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_streamed_and_whole_agree(client):
    messages = [{"role": "user", "content": "prefill, then decode"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    served(whole.model_extra["xds"])
    served(chunks[-1].model_extra["xds"])
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_concurrent_requests_reach_both_prefill_dies(client):
    """Enough at once that the JE's router uses both prefill dies (long and short prompts never
    share a prefill batch: pd.long_prompt_tokens 48) and the decode balancer several groups."""

    def one(i):
        prompt = f"request {i} " * (1 if i % 2 else 8)  # short and long prompts
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8 + i, extra_body={"ignore_eos": True}
        )
        assert resp.usage.completion_tokens == 8 + i
        return resp.model_extra["xds"]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    for xds in answers:
        served(xds)
    assert {x["prefill_die_rank"] for x in answers} == set(PREFILL)
    assert len({x["die_rank"] for x in answers}) > 1


def _open_stream(server: Server, prompt: str) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 900, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), server.headers())
    return conn


def test_client_disconnects(server):
    """One client goes away mid-stream (its request on a decode die), one before its first token
    (at prefill, or its KV on the way: the JE tells the decode die once the KV arrived). Both
    are dropped on their decode die at shutdown's count."""
    mid = _open_stream(server, "go on")
    resp = mid.getresponse()
    assert resp.status == 200
    assert [resp.readline() for _ in range(4)][0].startswith(b"data: ")  # tokens flowing
    early = _open_stream(server, "gone at once " * 60)  # a long prompt: a longer prefill
    time.sleep(0.05)
    for conn in (mid, early):
        conn.sock.close()
        conn.close()
    served({}, 2)
    SEEN["disconnected"] += ["go on", "gone at once " * 60]


def test_docs_curl_example_streams(server):
    """docs/serve.md's pd `curl -N` example, against this server."""
    page = (ROOT / "docs/serve.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in page.splitlines() if ln.startswith("curl -N ") and "prefill" in ln)
    argv = shlex.split(line.replace("http://127.0.0.1:8000", server.url))
    argv += ["--silent", "--max-time", "120"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=150, check=True).stdout
    events = [ln for ln in out.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
    served(last["xds"])


def test_shutdown_checks_every_request(server):
    """SIGTERM: the JE drains, stops every die, checks every request it took against the
    single-process reference and writes them, with the /pd group, in the run file."""
    output = server.stop()
    assert server.proc.returncode == 0, output[-3000:]
    num_requests, num_tokens, mismatches = server.check_line()
    assert (num_requests, mismatches) == (SEEN["requests"], 0)
    assert "2 of them ended early, compared as prefixes" in output
    with h5py.File(server.run_file()) as f:
        status = [s.decode() for s in f["requests/status"][:]]
        assert status.count("cancelled") == 2 and status.count("done") == num_requests - 2
        assert f["requests/num_tokens"][:].sum() == num_tokens
        arrivals = f["requests/arrival_s"][:]
        assert (arrivals > 0).all() and (np.diff(arrivals) >= 0).all()
        assert f["summary"].attrs["check_mismatches"] == 0
        # the requests that reached a decode die were dropped there (the other, if any, never
        # reached one: cancelled before its KV moved and before it was routed)
        cancelled = [i for i, s in enumerate(status) if s == "cancelled"]
        reached = sum(f["requests/die_rank"][i] >= 0 for i in cancelled)
        assert reached >= 1 and f["summary"].attrs["num_cancelled_on_dies"] == reached
        pd = f["pd"]
        rows = {int(r): i for i, r in enumerate(pd["req_id"][:])}
        parts = ("queue", "prefill", "kv_wait", "kv_transfer", "first_step")
        for req_id, xds in SEEN["xds"].items():
            row = rows[req_id]
            assert xds["prefill_die_rank"] == pd["prefill_rank"][row]
            assert xds["die_rank"] == pd["decode_rank"][row]
            ttft_ms = 1e3 * sum(pd[f"ttft_{p}_v_s"][row] for p in parts)
            assert xds["projected_ttft_ms"] == pytest.approx(ttft_ms, rel=1e-6)
