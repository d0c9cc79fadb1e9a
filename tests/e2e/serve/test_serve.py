"""`xds-mpi serve` end to end: the OpenAI SDK, raw HTTP and bad input against one live endpoint
on 127.0.0.1 (4 colocated dies); the last test shuts it down and checks every request it took
against the single-process reference.

The tests share the server and run in file order; each one adds the requests the server accepted
to ACCEPTED, which the shutdown's check must count exactly.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
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

KEY = "test-key"
MODEL = "xds-tiny"
MAX_QUEUED = 200
MAX_BODY = 65536
KV_CAPACITY = 64 * 16  # scheduler.num_kv_blocks_per_die x kv_block_tokens, set below
ACCEPTED = {"requests": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(
        tmp_path_factory.mktemp("serve"),
        "--max-queued",
        str(MAX_QUEUED),
        "--set",
        f"serve.max_body_bytes={MAX_BODY}",
        "--set",
        "scheduler.num_kv_blocks_per_die=64",
        api_key=KEY,
    )
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def accepted(n: int = 1) -> None:
    ACCEPTED["requests"] += n


def metric(server: Server, name: str, labels: str = "") -> float:
    """One sample of GET /metrics (0 when absent)."""
    status, text = server.get("/metrics")
    assert status == 200
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{[^}]*\})?")
    found = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(found.lastindex)) if found else 0.0


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert server.get("/health") == (200, '{"status": "ok"}')


def test_completion_streamed_and_whole_agree(client):
    whole = client.completions.create(model=MODEL, prompt="The pod", max_tokens=12)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The pod",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    accepted(2)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == len("The pod") + 1  # BOS
    assert 1 <= whole.usage.completion_tokens <= 12
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    xds = whole.model_extra["xds"]
    assert xds["die_rank"] in (1, 2, 3, 4) and xds["dp_group"] == xds["die_rank"] - 1
    assert xds["projected_ttft_ms"] > 0


def test_chat_streamed_and_whole_agree(client):
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, stream=True
    )
    chunks = list(stream)
    accepted(2)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    # The template: BOS, "<|user|>\nhello\n<|assistant|>\n".
    assert whole.usage.prompt_tokens == 1 + len("<|user|>\nhello\n<|assistant|>\n")


def test_ignore_eos_gives_max_tokens(client):
    resp = client.completions.create(
        model=MODEL, prompt=[256, 72, 105], max_tokens=24, extra_body={"ignore_eos": True}
    )
    accepted()
    assert resp.usage.completion_tokens == 24
    assert resp.choices[0].finish_reason == "length"


def test_stop_string_ends_the_text(client):
    full = client.completions.create(
        model=MODEL, prompt="stop here", max_tokens=32, extra_body={"ignore_eos": True}
    ).choices[0]
    text = full.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    cut = client.completions.create(
        model=MODEL, prompt="stop here", max_tokens=32, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    streamed = client.completions.create(
        model=MODEL,
        prompt="stop here",
        max_tokens=32,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed_text = "".join(c.choices[0].text for c in streamed if c.choices)
    accepted(3)
    assert cut.text == text[: text.index(stop)] == streamed_text
    assert cut.finish_reason == "stop"


BAD_BODIES = [
    # (name, body, status, fragment of the error message)
    ("not json", b"{not json", 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "must be a JSON object"),
    ("max_tokens a string", {"prompt": "a", "max_tokens": "8"}, 400, "must be an integer"),
    ("stream not a boolean", {"prompt": "a", "stream": "yes"}, 400, "stream must be a boolean"),
    ("no prompt", {}, 400, "prompt must be a string"),
    ("two prompts", {"prompt": ["a", "b"]}, 400, "a batch of 2 prompts"),
    ("unknown model", {"model": "gpt-9", "prompt": "a"}, 404, "`gpt-9` does not exist"),
    ("n > 1", {"prompt": "a", "n": 2}, 400, "n(2)"),
    ("temperature", {"prompt": "a", "temperature": 0.7}, 400, "greedy single-process reference"),
    ("top_p", {"prompt": "a", "top_p": 0.5}, 400, "top_p(0.5) is not supported"),
    ("logprobs", {"prompt": "a", "logprobs": 2}, 400, "logprobs(2) is not supported"),
    ("max_tokens 0", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("over max_seq_len", {"prompt": "a", "max_tokens": 5000}, 400, "model.max_seq_len(4096)"),
    (
        "over KV capacity",
        {"prompt": "a" * 1100},
        400,
        f"KV capacity 64 blocks x 16 = {KV_CAPACITY}",
    ),
    ("token id out of vocab", {"prompt": [256, 999]}, 400, "token id 999 outside"),
    ("stop not text", {"prompt": "a", "stop": 3}, 400, "stop must be"),
    ("stream_options alone", {"prompt": "a", "stream_options": {}}, 400, "only allowed with"),
]


@pytest.mark.parametrize("name,body,status,fragment", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_completion_request(server, name, body, status, fragment):
    if isinstance(body, dict):
        body = {"model": MODEL, **body}
    got, answer = server.post("/v1/completions", body)
    assert got == status, answer
    error = answer["error"]
    assert fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_bad_chat_request(server):
    got, answer = server.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}
    )
    assert got == 400 and "messages[0].role('robot') must be one of" in answer["error"]["message"]


def test_api_key_oversized_body_and_unknown_route(server):
    body = {"model": MODEL, "prompt": "a"}
    got, answer = server.post("/v1/completions", body, headers={})
    assert got == 401 and answer["error"]["type"] == "authentication_error"
    wrong = {"Authorization": "Bearer nope", "Content-Type": "application/json"}
    assert server.post("/v1/completions", body, headers=wrong)[0] == 401
    got, answer = server.post("/v1/completions", {**body, "prompt": "a" * (MAX_BODY + 1)})
    assert got == 413 and f"serve.max_body_bytes({MAX_BODY})" in answer["error"]["message"]
    got, answer = server.post("/v1/nothing", body)
    assert got == 404 and "error" in answer
    assert metric(server, "xds:http_errors_total", 'status="401"') >= 2


def test_bad_input_leaves_good_requests_alone(server, client):
    """Good requests sent among bad ones give the tokens they give alone."""
    prompts = [f"request {i}" for i in range(8)]

    def good(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8).choices[0].text

    alone = [good(p) for p in prompts]
    bad = [b for _, b, _, _ in BAD_BODIES] * 2
    with ThreadPoolExecutor(8) as pool:
        good_futures = [pool.submit(good, p) for p in prompts]
        bad_futures = [
            pool.submit(
                server.post, "/v1/completions", b if isinstance(b, bytes) else {"model": MODEL, **b}
            )
            for b in bad
        ]
        together = [f.result() for f in good_futures]
        statuses = [f.result()[0] for f in bad_futures]
    accepted(2 * len(prompts))
    assert together == alone
    assert all(s in (400, 404) for s in statuses)


def test_200_concurrent_streams(server):
    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"stream {i}",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        return [chunk async for chunk in stream]

    async def all_of_them():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(MAX_QUEUED)))

    results = asyncio.run(all_of_them())
    accepted(MAX_QUEUED)
    assert len(results) == MAX_QUEUED
    assert all(chunks[-1].usage.completion_tokens == 4 for chunks in results)
    ids = {chunks[0].id for chunks in results}
    assert len(ids) == MAX_QUEUED  # one request each


HOLD = "hold {} " + "." * 92  # 100 bytes: with 900 tokens, 63 KV blocks of a die's 64


def test_over_max_queued_gets_429(server):
    """More requests than serve.max_queued: each one over the limit gets 429 naming it, the
    open ones go on, and once they are gone requests are served their tokens again.

    The MAX_QUEUED open ones cannot end while the others are sent, however fast this machine
    connects clients (sent all at once, 16-token requests were served as fast as a quiet
    machine connected them, no 429, and on a loaded one some of the last got through): one
    stream per die (a 100-byte prompt, 900 tokens) holds 63 of its 64 KV blocks for 900
    iterations, and the other streams, 16 tokens each (2 blocks), wait in the TE-shell's queue
    until those are closed."""

    async def refused_or_served(client, i):
        try:
            resp = await client.completions.create(
                model=MODEL, prompt=f"q{i}", max_tokens=16, extra_body={"ignore_eos": True}
            )
            return resp.usage.completion_tokens
        except openai.RateLimitError as exc:
            return exc

    async def open_stream(client, prompt: str, max_tokens: int):
        return await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )

    async def over_the_limit():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300
        ) as client:
            streams = list(
                await asyncio.gather(*(open_stream(client, HOLD.format(d), 900) for d in range(4)))
            )
            try:
                wait_until(server, running=4)  # one holder per die: two do not fit one die
                waiting = MAX_QUEUED - len(streams)
                streams += await asyncio.gather(
                    *(open_stream(client, f"wait {i}", 16) for i in range(waiting))
                )
                wait_until(server, running=4, queued=waiting)  # all open on the TE-shell
                over = await asyncio.gather(*(refused_or_served(client, i) for i in range(20)))
                open_after = (metric(server, "vllm:num_requests_running"), queue_length(server))
                return over, open_after, waiting
            finally:
                for stream in streams:  # gone mid-stream: each cancelled where it is
                    await stream.close()

    async def under_the_limit():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(refused_or_served(client, i) for i in range(8)))

    refused, open_after, waiting = asyncio.run(over_the_limit())
    accepted(MAX_QUEUED)
    assert all(isinstance(r, openai.RateLimitError) for r in refused), refused
    assert open_after == (4, waiting), f"{open_after}: one ended while the others were sent"
    assert all(r.status_code == 429 for r in refused)
    assert all("200 requests open >= serve.max_queued(200)" in r.body["message"] for r in refused)
    wait_until(server, running=0)  # the closed streams cancelled, their KV back
    served = asyncio.run(under_the_limit())
    accepted(len(served))
    assert served == [16] * 8, served


def queue_length(server: Server) -> float:
    return metric(server, "vllm:num_requests_waiting")


def wait_until(server: Server, *, running: int, queued: int = 0, patience_s: float = 60) -> None:
    """Until the TE-shell counts `running` requests on its dies and `queued` in its queue
    (bounded)."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        now = (metric(server, "vllm:num_requests_running"), queue_length(server))
        if now == (running, queued):
            return
        time.sleep(0.1)
    raise AssertionError(f"(running, queued) {now} after {patience_s:g} s, not {running, queued}")


def test_client_disconnect_cancels_on_the_die(server):
    before = metric(server, "xds:requests_cancelled_total", 'reason="client disconnected"')
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 900, "stream": True}
    conn.request(
        "POST", "/v1/completions", json.dumps({**body, "ignore_eos": True}), server.headers()
    )
    resp = conn.getresponse()
    assert resp.status == 200
    lines = [resp.readline() for _ in range(6)]  # three events: tokens are flowing
    assert lines[0].startswith(b"data: ")
    conn.sock.close()  # gone, mid-stream
    conn.close()
    accepted()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = metric(server, "xds:requests_cancelled_total", 'reason="client disconnected"')
        running = metric(server, "vllm:num_requests_running")
        if after == before + 1 and running == 0:
            break
        time.sleep(0.2)
    assert after == before + 1
    assert running == 0  # nothing left on a die: its KV reservation is back
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0


def test_docs_curl_example_streams(server):
    """docs/serve.md's `curl -N` example, against this server (its address and key)."""
    page = (ROOT / "docs/serve.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in page.splitlines() if ln.startswith("curl -N "))
    argv = shlex.split(line.replace("http://127.0.0.1:8000", server.url))
    argv += ["-H", f"Authorization: Bearer {KEY}", "--silent", "--max-time", "120"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=150, check=True).stdout
    accepted()
    events = [ln for ln in out.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_metrics_count_what_was_served(server):
    assert metric(server, "vllm:generation_tokens_total") > 0
    assert metric(server, "vllm:time_to_first_token_seconds_count") > 0
    assert metric(server, "xds:projected_time_per_output_token_seconds_count") > 0
    assert metric(server, "xds:die_iteration_seconds_count", 'die="1"') > 0


def test_shutdown_checks_every_request(server):
    """SIGTERM: the TE-shell drains (a stream open at the signal still gets all its tokens),
    stops every die, checks every request it took against the single-process reference and
    writes them in the run file with their arrival times."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"model": MODEL, "prompt": "drain me", "max_tokens": 40, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), server.headers())
    resp = conn.getresponse()
    first = resp.readline()  # admitted, tokens flowing
    with ThreadPoolExecutor(1) as pool:
        stopping = pool.submit(server.stop)
        rest = resp.read().decode()  # until the server ends the stream
        output = stopping.result()
    conn.close()
    accepted()
    events = [ln for ln in (first.decode() + rest).splitlines() if ln.startswith("data: {")]
    assert json.loads(events[-1][6:])["usage"]["completion_tokens"] == 40
    assert rest.rstrip().endswith("data: [DONE]")
    assert "serve: no new requests; draining 1 open ones" in output
    assert server.proc.returncode == 0, output[-3000:]
    num_requests, num_tokens, mismatches = server.check_line()
    assert (num_requests, mismatches) == (ACCEPTED["requests"], 0)
    with h5py.File(server.run_file()) as f:
        status = [s.decode() for s in f["requests/status"][:]]
        assert len(status) == ACCEPTED["requests"]
        assert set(status) <= {"done", "cancelled"}
        assert f["requests/num_tokens"][:].sum() == num_tokens
        summary = f["summary"].attrs
        assert summary["check_mismatches"] == 0
        # the disconnected client's request was still on its die: dropped there, KV freed
        assert summary["num_cancelled_on_dies"] >= 1 and summary["cancelled_kv_blocks_freed"] >= 1
        arrivals = f["requests/arrival_s"][:]  # in the order the endpoint took them
    assert (arrivals > 0).all() and (np.diff(arrivals) >= 0).all()
