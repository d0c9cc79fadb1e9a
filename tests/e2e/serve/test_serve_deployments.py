"""`xds-mpi serve` on the other decode paths: afd (attention and expert dies) and colocated with
MTP depth 2. A request a stop string ends early is dropped on its die, and --check compares
its tokens and MTP steps with the reference's first ones."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

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


DEAD_DIE = (
    "faults.events=[{kind: dead, die: 2, iteration: 8}]",
    "health.timeout_s=4",
    "health.dp_interval_s=0.2",
    "faults.on_timeout=recompute",
    "xccl.poll_timeout_s=1",
    "deployment.redundant_slots_per_die=4",
    "health.replicas=ring",
)


@pytest.mark.timeout(600)
def test_serve_through_a_dead_die(tmp_path):
    """A die dies while the endpoint's requests run on it: the TE-shell scales down, re-prefills
    its requests on the others, and every client still gets all its tokens, checked. GET /health
    answers 503 from the fence until the survivors serve again, 200 after; a request sent while
    it answers 503 is still taken, and served once they do."""
    server = Server(tmp_path, *(a for s in DEAD_DIE for a in ("--set", s)), timeout_s=400)
    health: list[tuple[int, str]] = []  # every answer of GET /health, in order
    during: list = []  # the answer to the request sent while failing over
    done = threading.Event()

    def one(i):
        body = {"model": MODEL, "prompt": f"die {i}", "max_tokens": 24, "ignore_eos": True}
        return server.post("/v1/completions", body)

    def watch_health():
        while not done.is_set():
            health.append(server.get("/health"))
            if health[-1][0] == 503 and not during:
                during.append(one(99))  # blocks until served, after the failover
            time.sleep(0.05)

    try:
        server.wait_ready()
        watcher = threading.Thread(target=watch_health)
        watcher.start()
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, range(12)))
        while not during and watcher.is_alive() and len(health) < 400:
            time.sleep(0.1)  # the request sent during the failover is not among the 12
        done.set()
        watcher.join(120)
        after = server.get("/health")
    finally:
        output = server.stop()
    assert [status for status, _ in answers] == [200] * 12
    assert all(body["usage"]["completion_tokens"] == 24 for _, body in answers)
    failing = [body for status, body in health if status == 503]
    assert failing and all("failing over" in body for body in failing), health
    assert health[0][0] == 200
    # 200 again after the failover: `after`, asked once the watcher stopped (the watcher itself
    # may stop before it polls again: it waits in the request it sent during the 503).
    assert after == (200, '{"status": "ok"}')
    assert len(during) == 1 and during[0][0] == 200
    assert during[0][1]["usage"]["completion_tokens"] == 24
    assert "failure dead on colocated die 2 at iteration 8: detected" in output
    assert "vertical scaling: 4 -> 3 decode dies" in output
    assert server.check_line() == (13, 13 * 24, 0)
