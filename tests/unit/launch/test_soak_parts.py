"""The soak's parts (launch/serve/soak.py, soak_clients.py): its schedule is a config the
validator accepts, each row at its fraction of the measured window; a client sorts each reply
into its kind, and only the kinds it cannot retry count as errors."""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import pytest
from aiohttp import web

from launch.serve.soak import SCHEDULE, fault_schedule, serve_sets
from launch.serve.soak_clients import Outcomes, one
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import load_config
from xds_mpi.plan.deployment import DeploymentPlan


def test_the_schedule_places_each_row_after_warm_up():
    events = fault_schedule(warmup_s=30, duration_s=600, iterations_per_s=20)
    # (30 + fraction * 600) * 20
    assert [f"iteration: {i}," in events for i in (2400, 4200, 6600, 9000)] == [True] * 4
    assert events.count("{iteration:") == len(SCHEDULE)


def test_the_schedule_is_a_deployment_the_validator_accepts():
    args = argparse.Namespace(
        dir="/tmp/x", warmup_s=30, faults=True, iterations_per_s=20, fault_rate=0.01, set=[]
    )
    sets = [*serve_sets(args, 600), "serve.enabled=true", "run.check=true"]
    plan = DeploymentPlan.build(load_config(resolve_config("colocated"), sets), 5)
    kinds = [
        (e.kind, e.die, e.duration_s if e.kind == "stuck" else None) for e in plan.cfg.faults.events
    ]
    assert kinds == [("stuck", 2, 1.5), ("dead", 1, None), ("stuck", 4, 1.0), ("stuck", 3, 0.0)]


def _sse(*chunks: str) -> bytes:
    return "".join(f"data: {c}\n\n" for c in chunks).encode()


WHOLE = '{"choices": [{"finish_reason": "length"}], "usage": {"completion_tokens": 4}}'
SHORT = '{"choices": [{"finish_reason": "stop"}], "usage": {"completion_tokens": 2}}'
ABORT = '{"choices": [{"finish_reason": "abort"}], "usage": {"completion_tokens": 1}}'
REPLIES = {
    "whole": (200, _sse(WHOLE, "[DONE]")),
    "short": (200, _sse(SHORT, "[DONE]")),
    "cut": (200, _sse('{"choices": [{"text": "a"}]}')),
    "abort": (200, _sse(ABORT, "[DONE]")),
    "busy": (429, b'{"error": {}}'),
    "failing_over": (503, b'{"error": {}}'),
    "bad": (400, b'{"error": {}}'),
}


@pytest.mark.parametrize(
    ("reply", "kind", "tokens"),
    [
        ("whole", "ok", 4),
        ("short", "short", 0),
        ("cut", "incomplete", 0),
        ("abort", "abort", 0),
        ("busy", "http_429", 0),
        ("failing_over", "http_503", 0),
        ("bad", "http_400", 0),
    ],
)
def test_a_reply_is_sorted_into_its_kind(reply, kind, tokens):
    status, body = REPLIES[reply]

    async def handler(request):
        return web.Response(status=status, body=body, content_type="text/event-stream")

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                return await one(session, f"http://127.0.0.1:{port}", [256, 40], 4)
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == (kind, tokens)


def test_only_what_a_client_cannot_retry_is_an_error():
    outcomes = Outcomes()
    outcomes.kinds.update({"ok": 10, "http_429": 3, "http_503": 2})
    assert outcomes.num_errors == 0
    outcomes.kinds.update({"http_400": 1, "connection": 1, "short": 1})
    assert outcomes.num_errors == 3
