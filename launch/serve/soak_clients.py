"""The soak's clients and its watch on the job's processes: `streams` streaming clients that
each send one completion after another until a deadline, every outcome counted by kind; and
each rank's RSS read from /proc, the ranks found by a marker in their environment.

A refusal with a status a client may retry (429: too many open, 503: not ready or shutting
down) is counted under its status and retried after a short pause; any other status, a
connection that fails, a stream cut short or a reply shorter than asked is an error of its own
kind, which the soak reports and its test fails on.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

RETRYABLE = (429, 503)  # the statuses a client retries (OpenAI's SDK does too)
RETRY_PAUSE_S = 0.2
MARKER_ENV = "XDS_SOAK_ID"  # set on the launcher, inherited by mpiexec and every rank
RANK_ENVS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")  # MPICH, Open MPI


@dataclass
class Outcomes:
    """What the clients saw. `kinds`: "ok", "http_<status>" (a refusal; retried when the status
    is in RETRYABLE), "connection", "incomplete" (no [DONE]), "short" (fewer tokens than asked),
    "abort" (finish_reason abort: a request a memory fault took). `tokens`: tokens received in
    the "ok" replies."""

    kinds: Counter = field(default_factory=Counter)
    tokens: int = 0

    @property
    def num_errors(self) -> int:
        """Outcomes a client cannot retry its way out of."""
        return sum(n for kind, n in self.kinds.items() if kind != "ok" and not is_retryable(kind))


def is_retryable(kind: str) -> bool:
    return kind in {f"http_{status}" for status in RETRYABLE}


async def drive(url: str, prompts: list[list[int]], max_tokens: int, streams: int, until: float):
    """`streams` clients, each sending the prompts in turn (each client from its own offset)
    until the monotonic time `until`; their Outcomes."""
    import aiohttp  # here: a measured start-up cost of every command

    outcomes = Outcomes()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(idx: int) -> None:
            sent = idx
            while time.monotonic() < until:
                prompt = prompts[sent % len(prompts)]
                sent += streams
                kind, tokens = await one(session, url, prompt, max_tokens)
                outcomes.kinds[kind] += 1
                outcomes.tokens += tokens
                if kind != "ok":
                    await asyncio.sleep(RETRY_PAUSE_S)

        await asyncio.gather(*(client(i) for i in range(streams)))
    return outcomes


async def one(session, url: str, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """One streaming completion: (its outcome's kind, tokens received)."""
    import aiohttp  # here: a measured start-up cost of every command

    body = {
        "model": "xds-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return f"http_{resp.status}", 0
            usage, reason, done = None, None, False
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        reason = choice.get("finish_reason") or reason
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return "connection", 0
    if not done or usage is None:
        return "incomplete", 0
    if reason == "abort":
        return "abort", 0
    tokens = usage["completion_tokens"]
    return ("ok", tokens) if tokens == max_tokens else ("short", 0)


def job_ranks(marker: str) -> dict[int, int]:
    """{rank: pid} of the MPI ranks whose environment carries MARKER_ENV=marker."""
    ranks = {}
    for pid, env in _environments(marker):
        for name in RANK_ENVS:
            if name in env:
                ranks[int(env[name])] = pid
    return ranks


def job_processes(marker: str) -> list[int]:
    """Every live process (the launcher, mpiexec, its proxies, the ranks) with the marker."""
    return [pid for pid, _ in _environments(marker)]


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB (nan once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _environments(marker: str):
    wanted = f"{MARKER_ENV}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "environ").read_bytes()
            if wanted not in raw.split(b"\0") or _is_zombie(entry):
                continue
        except OSError:
            continue
        pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        yield int(entry.name), {k.decode(): v.decode(errors="replace") for k, v in pairs}


def _is_zombie(entry: Path) -> bool:
    stat = (entry / "stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
