"""`xds-mpi serve` on a cluster (docs/serve.md, "A cluster"): the endpoint on the JE (world rank
0) in front of 2 colocated TEs of 2 dies (7 ranks: JE, TE 0 at 1..3, TE 1 at 4..6). The JE routes
each request at once by cluster.policy (round_robin here: they alternate), its TE-shell serves
it and streams the tokens back through the JE. The last test of the shared server shuts it down
and checks every request against the reference, whichever TE served it; the last test of the
file loses a die of one TE and watches GET /health.

The tests share the server and run in file order; each one adds the requests the server accepted
to ACCEPTED, which the shutdown's check must count exactly.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import openai
import pytest
from serve_harness import Server

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan

pytestmark = pytest.mark.timeout(600)

MODEL = "xds-tiny"
TWO_TES = ("--set", "cluster.num_tes=2", "--set", "deployment.dp_groups_per_domain=2")
DIES_OF = {0: (2, 3), 1: (5, 6)}  # TE -> its dies' world ranks
ACCEPTED = {"requests": 0, "cancelled": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve_cluster"), *TWO_TES, timeout_s=400)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(server: Server, name: str, labels: str = "") -> float:
    """One sample of GET /metrics (0 when absent)."""
    status, text = server.get("/metrics")
    assert status == 200
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{[^}]*\})?")
    found = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(found.lastindex)) if found else 0.0


def te_of_die(die: int) -> int:
    return next(te for te, dies in DIES_OF.items() if die in dies)


def test_a_served_cluster_refuses_what_it_does_not_build():
    """No MPI: PD pairs and several JEs are refused with serve, naming them."""
    for config, sets, refused in [
        ("cluster", [], "does not support a PD pair"),
        ("colocated", ["cluster.num_tes=2", "cluster.num_jes=2"], "num_jes"),
    ]:
        cfg = load_config(f"configs/{config}.yaml", ["serve.enabled=true", *sets])
        with pytest.raises(ConfigError, match=refused):
            DeploymentPlan.build(cfg, None, launcher_checks=False)
    served = load_config("configs/colocated.yaml", ["serve.enabled=true", "cluster.num_tes=2"])
    assert DeploymentPlan.build(served, None, launcher_checks=False).cluster.num_tes == 2


def test_concurrent_streams_are_served_by_both_tes(client):
    """8 concurrent streaming completions: each gets all its tokens in several events, the
    same text as asked whole, and the two TEs' dies both served (round_robin alternates)."""

    def stream(i):
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=f"cluster {i}",
                max_tokens=12 + i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return chunks[-1].usage.completion_tokens, len(chunks), text, chunks[-1].model_extra["xds"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(stream, range(8)))
    ACCEPTED["requests"] += 8
    assert [n for n, *_ in answers] == [12 + i for i in range(8)]
    assert all(events > 3 for _, events, _, _ in answers)  # streamed, not one in all
    dies = {xds["die_rank"] for *_, xds in answers}
    assert {te_of_die(d) for d in dies} == {0, 1}, dies
    assert all(
        xds["dp_group"] == DIES_OF[te_of_die(xds["die_rank"])].index(xds["die_rank"])
        for *_, xds in answers
    )
    whole = client.completions.create(
        model=MODEL, prompt="cluster 3", max_tokens=15, extra_body={"ignore_eos": True}
    )
    ACCEPTED["requests"] += 1
    assert whole.choices[0].text == answers[3][2]


def test_client_disconnect_cancels_on_its_te(server):
    """A client gone mid-stream: the JE tells the request's TE-shell, whose die drops it and
    frees its KV (counted in the run file at shutdown: num_cancelled_on_dies)."""
    before = metric(server, "xds:requests_cancelled_total", 'reason="client disconnected"')
    finished = [metric(server, "xds:te_requests_finished_total", f'te="{te}"') for te in (0, 1)]
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
    ACCEPTED["requests"] += 1
    ACCEPTED["cancelled"] += 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = metric(server, "xds:requests_cancelled_total", 'reason="client disconnected"')
        running = [metric(server, "xds:te_requests_running", f'te="{te}"') for te in (0, 1)]
        if after == before + 1 and running == [0, 0]:
            break
        time.sleep(0.2)
    assert after == before + 1
    assert running == [0, 0]  # off its TE's die, as that TE-shell reports
    # dropped there, not served to its end (900 tokens take ~10 s here)
    assert [metric(server, "xds:te_requests_finished_total", f'te="{te}"') for te in (0, 1)] == (
        finished
    )
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0


def test_metrics_have_per_te_series(server):
    finished = [metric(server, "xds:te_requests_finished_total", f'te="{te}"') for te in (0, 1)]
    assert min(finished) > 0 and sum(finished) == ACCEPTED["requests"] - ACCEPTED["cancelled"]
    for te, dies in DIES_OF.items():
        assert metric(server, "xds:te_kv_cache_usage_perc", f'te="{te}"') == 0.0
        assert metric(server, "xds:te_failing_over", f'te="{te}"') == 0.0
        # the dies' token batches, by world rank, as each TE-shell forwarded them
        assert all(
            metric(server, "xds:die_iteration_seconds_count", f'die="{d}"') > 0 for d in dies
        )
    assert metric(server, "vllm:generation_tokens_total") > 0


def test_shutdown_checks_every_request_whichever_te_served_it(server):
    output = server.stop()
    assert server.proc.returncode == 0, output[-3000:]
    num_requests, num_tokens, mismatches = server.check_line()
    assert (num_requests, mismatches) == (ACCEPTED["requests"], 0)
    assert "1 of them ended early, compared as prefixes" in output
    with h5py.File(server.run_file()) as f:
        assert f.attrs["world_size"] == 7
        te = f["cluster/te"][:]
        die = f["requests/die_rank"][:]
        assert len(te) == ACCEPTED["requests"] and set(te) == {0, 1}
        assert all(d in DIES_OF[t] for t, d in zip(te, die, strict=True)), (te, die)
        assert np.all(np.diff(f["cluster/routed_s"][:]) >= 0)
        assert [s.decode() for s in f["cluster/te_status"][:]] == ["completed"] * 2
        summary = f["summary"].attrs
        assert summary["check_mismatches"] == 0
        assert summary["num_cancelled_on_dies"] == 1  # the disconnected client's, on its TE
        assert f["requests/num_tokens"][:].sum() == num_tokens


def test_two_afd_tes_serve_and_check(tmp_path):
    """Two afd TEs (17 ranks): requests routed to both, every token equal to the reference."""
    server = Server(tmp_path, "afd", "--set", "cluster.num_tes=2", timeout_s=400)
    try:
        server.wait_ready()
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda i: server.post(
                        "/v1/completions",
                        {"model": MODEL, "prompt": f"afd {i}", "max_tokens": 8, "ignore_eos": True},
                    ),
                    range(4),
                )
            )
    finally:
        output = server.stop()
    assert [status for status, _ in answers] == [200] * 4, answers
    assert server.check_line() == (4, 32, 0)
    assert "cluster: TE 0 served 2 requests, TE 1 served 2 requests" in output


FAULTY_TE = (
    "deployment.dp_groups_per_domain=2",
    "health.timeout_s=4",
    "health.dp_interval_s=0.2",
    "faults.on_timeout=recompute",
    "xccl.poll_timeout_s=1",
    "cluster.groups=[{count: 1, name: faulty, set: ['faults.events=[{kind: dead, die: 2, "
    "iteration: 8}]', health.replicas=ring, deployment.redundant_slots_per_die=8]}, {count: 1}]",
)


def test_health_is_503_while_a_die_of_one_te_fails_over(tmp_path):
    """TE 0's die 2 (world rank 3) dies while requests run on both TEs: TE 0's TE-shell scales
    down to its other die, and the JE's GET /health answers 503 from its fence until it serves
    again, 200 after; every client still gets all its tokens, checked."""
    server = Server(tmp_path, *(a for s in FAULTY_TE for a in ("--set", s)), timeout_s=400)
    health: list[tuple[int, str]] = []  # every answer of GET /health, in order
    done = threading.Event()

    def one(i):
        body = {"model": MODEL, "prompt": f"die {i}", "max_tokens": 24, "ignore_eos": True}
        return server.post("/v1/completions", body)

    def watch_health():
        while not done.is_set():
            health.append(server.get("/health"))
            time.sleep(0.05)

    try:
        server.wait_ready()
        watcher = threading.Thread(target=watch_health)
        watcher.start()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(8)))
        deadline = time.monotonic() + 60
        while health[-1][0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        done.set()
        watcher.join(60)
        failing_over = metric(server, "xds:te_failing_over", 'te="0"')
        detected = metric(server, "xds:failures_detected_total")
    finally:
        output = server.stop()
    assert [status for status, _ in answers] == [200] * 8
    assert all(body["usage"]["completion_tokens"] == 24 for _, body in answers)
    failing = [body for status, body in health if status == 503]
    assert failing and all("failing over" in body for body in failing), health
    assert health[0][0] == 200 and health[-1] == (200, '{"status": "ok"}')
    assert (failing_over, detected) == (0.0, 1.0)
    assert "vertical scaling: 2 -> 1 decode dies" in output
    assert server.check_line() == (8, 8 * 24, 0)


def test_a_lost_te_s_open_requests_are_served_again_by_the_other_and_no_token_twice(tmp_path):
    """TE 0 lost whole 0.5 s after every TE serves (found 1.5 + 0.2 s later, health.timeout_s +
    dp_interval_s)
    while 6 long completions stream on both TEs: the JE takes none of TE 0's news from its loss
    on, then routes its open requests to TE 1, which serves them from their prompts; every
    client gets each of its tokens once, all equal to the reference; TE 0 serves nothing after."""
    server = Server(
        tmp_path,
        *TWO_TES,
        *("--set", "cluster.te_losses=[{te: 0, at_s: 0.5}]", "--set", "health.timeout_s=1.5"),
        timeout_s=400,
    )

    def one(i):
        body = {"model": MODEL, "prompt": f"lost {i}", "max_tokens": 160, "ignore_eos": True}
        return server.post("/v1/completions", body)

    try:
        server.wait_ready()
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(one, range(6)))
        deadline = time.monotonic() + 30  # found 2.2 s after serving began, whatever the speed
        while (lost := metric(server, "xds:te_lost", 'te="0"')) != 1.0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        output = server.stop()
    assert [status for status, _ in answers] == [200] * 6
    assert all(body["usage"]["completion_tokens"] == 160 for _, body in answers)
    assert lost == 1.0
    assert server.check_line() == (6, 6 * 160, 0)
    with h5py.File(server.run_file(), "r") as f:
        cluster = f["cluster"]
        te, first = cluster["te"][()], cluster["first_te"][()]
        again = first != te
        # the premise: TE 0 held open requests at its loss (160 tokens outlast 0.5 s)
        assert again.sum() >= 1 and set(first[again]) == {0} and set(te[again]) == {1}
        assert f["summary"].attrs["rerouted_requests"] == again.sum()
        assert cluster["te_status"][0].decode().startswith("lost at 0.5 s, found at ")
        found = cluster["te_found_s"][0]
        assert 2.2 <= found < 2.2 + 5  # timeout_s + dp_interval_s after, within a few turns
    assert "requests routed again" in output
