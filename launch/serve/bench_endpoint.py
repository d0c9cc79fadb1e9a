"""`xds-mpi bench endpoint`: what the HTTP endpoint costs. The same requests (the config's
synthetic workload at fixed lengths, EOS ignored) are served from the YAML workload by
`xds-mpi run` and through `xds-mpi serve` by `--streams` concurrent streaming clients, alternating
`--repeat` times so both see the same load; the table gives tokens/s of each and their ratio.

tokens/s from YAML is the TE-shell's summary (frontend start to the last token); through the
endpoint it is the clients' (first request sent to the last token received), so the endpoint's
parsing, queueing, event-loop hops and server-sent events all count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from launch.bench.results import report
from launch.serve.bench import run_launcher
from launch.serve.stats import SUMMARY
from xds_mpi.config.paths import DEFAULT_CONFIG, resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.workload.stream import synthetic_requests

COLUMNS = ["requests", "streams", "tokens", "yaml_tokens_s", "endpoint_tokens_s", "ratio"]
COLUMNS += ["endpoint_errors"]


def workload_sets(args) -> list[str]:
    return [
        f"workload.num_requests={args.requests}",
        f"workload.prompt_len={args.prompt_len}",
        f"workload.output_len={args.output_len}",
        "workload.length_dist=fixed",
        "workload.arrival=all_at_once",
        "workload.ignore_eos=true",
        "run.trace=false",
        *args.set,
    ]


def from_yaml(args, tmp: str) -> tuple[int, float]:
    """(tokens, tokens/s) of `xds-mpi run` on the workload."""
    command = [sys.executable, "-m", "launch.cli", "run", str(args.config)]
    for text in [*workload_sets(args), f"run.output_dir={tmp}"]:
        command += ["--set", text]
    done = run_launcher(command, cwd=Path.cwd(), env=dict(os.environ), timeout_s=args.timeout)
    output = done.stdout + done.stderr
    found = SUMMARY.search(output)
    if done.returncode or not found:
        raise SystemExit(f"bench endpoint: the run failed ({done.returncode}):\n{output[-3000:]}")
    return int(found.group(1)), float(found.group(3))


def through_endpoint(args, tmp: str, port: int) -> tuple[int, float, int]:
    """(tokens, tokens/s, errors) of the same requests sent to `xds-mpi serve`."""
    cfg = load_config(args.config, workload_sets(args))
    prompts = [list(r.prompt) for r in synthetic_requests(cfg.workload)]
    command = [sys.executable, "-m", "launch.cli", "serve", str(args.config), "--port", str(port)]
    for text in [*workload_sets(args), f"run.output_dir={tmp}"]:
        command += ["--set", text]
    log = Path(tmp, "serve.log")
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_ready(url, args.timeout, proc))
            return asyncio.run(drive(url, prompts, args.output_len, args.streams))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(args.timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # the second one ends every rank
                proc.wait()


async def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    """Until `url`'s /health answers 200; SystemExit past `timeout_s` or if `proc` ends."""
    import aiohttp  # here: a measured start-up cost of every command

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"xds-mpi serve at {url}: not ready in {timeout_s:g} s (or it ended)")


async def drive(url: str, prompts, max_tokens: int, streams: int) -> tuple[int, float, int]:
    """Send every prompt as a streaming completion, `streams` at a time; (tokens received,
    tokens/s from the first send to the last token, requests that failed)."""
    import aiohttp  # here: a measured start-up cost of every command

    gate = asyncio.Semaphore(streams)
    tokens, errors = [], []

    async def one(session, prompt) -> None:
        body = {
            "model": "xds-tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with gate, session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                errors.append(resp.status)
                return
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens.append(usage["completion_tokens"])

    connector = aiohttp.TCPConnector(limit=streams)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        wall = time.perf_counter() - started
    return sum(tokens), sum(tokens) / wall, len(errors)


def cmd_bench_endpoint(args: argparse.Namespace) -> int:
    args.config = resolve_config(args.config)
    if min(args.requests, args.streams, args.repeat) < 1:
        raise ConfigError("bench endpoint: --requests, --streams and --repeat must be >= 1")
    yaml, endpoint = [], []
    for _ in range(args.repeat):  # alternate, so both see the same load
        with tempfile.TemporaryDirectory(prefix="xds-bench-endpoint-") as tmp:
            yaml.append(from_yaml(args, tmp))
            endpoint.append(through_endpoint(args, tmp, free_port()))
        print(f"  served {args.requests} requests both ways", flush=True)
    yaml_tps = float(np.median([r[1] for r in yaml]))
    endpoint_tps = float(np.median([r[1] for r in endpoint]))
    row = {
        "requests": args.requests,
        "streams": args.streams,
        "tokens": int(np.median([r[0] for r in endpoint])),
        "yaml_tokens_s": yaml_tps,
        "endpoint_tokens_s": endpoint_tps,
        "ratio": endpoint_tps / yaml_tps,
        "endpoint_errors": sum(r[2] for r in endpoint),
    }
    title = (
        f"xds-mpi bench endpoint: {args.config.name}, prompt {args.prompt_len} + output "
        f"{args.output_len} tokens, median of {args.repeat}"
    )
    legend = (
        "yaml_tokens_s: xds-mpi run's summary; endpoint_tokens_s: the clients' (first send to "
        "last token); ratio: endpoint / yaml."
    )
    report([row], COLUMNS, args, title=title, legend=legend)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_parser(kinds) -> None:
    p = kinds.add_parser(
        "endpoint",
        help="tokens/s through xds-mpi serve vs the same workload from YAML",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="a colocated or afd config")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="runs of each (median)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", default="", help="write the table to FILE.csv or FILE.h5")
    p.add_argument("--profile", default="ascend910c", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.set_defaults(func=cmd_bench_endpoint)
