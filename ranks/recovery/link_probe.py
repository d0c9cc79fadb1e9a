"""Link probing of the KV-transfer path (xDeepServe §6.1), both ends.

The KV transfer runs beside the dies' event loops, so heartbeats cannot see it stall. The
prefill die (the sender) watches its transfers' outcomes: a KV send to a decode die that has
made no progress for health.probe_interval_s makes that pair suspect, and the die injects a
dummy payload into the channel (a Probe to the decode die, which echoes it from its KV-receive
path). The echo tells the cause apart:
- no echo within health.probe_timeout_s: nothing passes the pair: verdict "link";
- an echo later than health.probe_slow_s: the channel passes but the decode die drains it late:
  verdict "saturated";
- an echo in time: the send was merely slow (a busy decode iteration): no verdict.
Once a verdict stands the pair is probed every interval until a dummy passes ("restored" after
a link fault) or passes in time ("cleared" after saturation). Every verdict goes to the JE
(LinkReport), which re-routes (link) or routes around the die (saturated), ranks/shell/je.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

from ranks.core.control import wait_all
from ranks.core.die_io import SHELL
from ranks.core.tags import TAG_PD_ECHO, TAG_PD_PROBE, TAG_PD_VERDICT


@dataclass(frozen=True, kw_only=True)
class Probe:
    """A dummy payload on pair prefill -> decode (its bytes ride along like a small KV chunk)."""

    seq: int
    prefill: int
    payload: bytes = bytes(256)


@dataclass(frozen=True, kw_only=True)
class LinkReport:
    """What the prober concluded about pair prefill -> decode. kind: "link", "saturated",
    "restored", "cleared", or "reroute" (more requests withdrawn from a pair already down).
    wall: time.time(); virtual_s: the prefill die's clock; rtt_s: the dummy's round trip (-1:
    none came back); req_ids: the requests whose KV sends were waiting on the pair (for "link"
    and "reroute": withdrawn, to go over another pair)."""

    kind: str
    prefill: int
    decode: int
    wall: float
    virtual_s: float
    rtt_s: float = -1.0
    req_ids: tuple[int, ...] = ()


@dataclass(kw_only=True)
class PairProbe:
    """One pair's probing state: its standing verdict ("" none) and the dummy in flight."""

    verdict: str = ""
    seq: int = 0
    sent_at: float = -1.0  # time.monotonic() of the dummy in flight (-1: none)
    last_sent: float = 0.0


class LinkProber:
    """The prefill die's side: `step(outstanding)` once per loop turn, where outstanding maps a
    decode die to (time.monotonic() of its oldest KV send without progress, the requests)."""

    def __init__(self, comm, rank: int, health, clock, drops) -> None:
        # drops(decode): the injected channel swallows what is sent there (ranks/pd/channel.py)
        self.comm, self.rank, self.clock, self.drops = comm, rank, clock, drops
        self.interval_s, self.timeout_s = health.probe_interval_s, health.probe_timeout_s
        self.slow_s, self.is_enabled = health.probe_slow_s, health.enabled
        self.pairs: dict[int, PairProbe] = {}
        self.sends: list[MPI.Request] = []
        self.num_probes = 0

    def verdict(self, decode: int) -> str:
        return self.pairs[decode].verdict if decode in self.pairs else ""

    def step(self, outstanding: dict[int, tuple[float, tuple[int, ...]]]) -> list[LinkReport]:
        if not self.is_enabled:
            return []
        now = time.monotonic()
        reports = self._take_echoes(now, outstanding)
        for decode, pair in self.pairs.items():
            if pair.sent_at >= 0 and now - pair.sent_at > self.timeout_s:
                pair.sent_at = -1.0  # Step 2: nothing passed the pair in probe_timeout_s
                if pair.verdict != "link":
                    pair.verdict = "link"
                    reports.append(self._report("link", decode, -1.0, outstanding))
        for decode in set(outstanding) | set(self.pairs):
            self._maybe_probe(decode, now, outstanding)
        self.sends = [r for r in self.sends if not r.Test()]
        return reports

    def _maybe_probe(self, decode: int, now: float, outstanding) -> None:
        """Step 1: a pair whose oldest send is stuck, or that has a verdict, gets a dummy."""
        pair = self.pairs.setdefault(decode, PairProbe())
        if pair.sent_at >= 0 or now - pair.last_sent < self.interval_s:
            return
        is_stuck = decode in outstanding and now - outstanding[decode][0] > self.interval_s
        if not (is_stuck or pair.verdict):
            return
        pair.seq += 1
        pair.sent_at = pair.last_sent = now
        self.num_probes += 1
        if not self.drops(decode):
            probe = Probe(seq=pair.seq, prefill=self.rank)
            self.sends.append(self.comm.isend(probe, dest=decode, tag=TAG_PD_PROBE))

    def _take_echoes(self, now: float, outstanding) -> list[LinkReport]:
        """Step 2: a dummy back late means saturation; back at all ends a link verdict."""
        reports = []
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_ECHO)) is not None:
            status = MPI.Status()
            echo: Probe = msg.recv(status=status)
            pair = self.pairs.get(status.Get_source())
            if pair is None or echo.seq != pair.seq or pair.sent_at < 0:
                continue  # a dummy given up on already
            decode, rtt = status.Get_source(), now - pair.sent_at
            pair.sent_at = -1.0
            kind = _after_echo(pair.verdict, is_late=rtt > self.slow_s)
            if kind:
                pair.verdict = "saturated" if kind == "saturated" else ""
                reports.append(self._report(kind, decode, rtt, outstanding))
        return reports

    def _report(self, kind: str, decode: int, rtt: float, outstanding) -> LinkReport:
        return LinkReport(
            kind=kind,
            prefill=self.rank,
            decode=decode,
            wall=time.time(),
            virtual_s=self.clock(),
            rtt_s=rtt,
            req_ids=tuple(outstanding.get(decode, (0.0, ()))[1]),
        )

    def tell(self, report: LinkReport) -> None:
        self.sends.append(self.comm.isend(report, dest=SHELL, tag=TAG_PD_VERDICT))

    def close(self, *, timeout_s: float) -> None:
        """Probes to the decode dies (which take them until their own end) and verdicts to the
        JE, complete within `timeout_s`."""
        wait_all(self.sends, timeout_s=timeout_s, me=f"die rank {self.rank}", event="link probes")


def _after_echo(verdict: str, *, is_late: bool) -> str:
    """The report an echo makes, given the pair's standing verdict ("" for none)."""
    if verdict == "link":
        return "restored"
    if verdict == "saturated":
        return "" if is_late else "cleared"
    return "saturated" if is_late else ""


class ProbeEchoer:
    """The decode die's side: each dummy is echoed from the KV-receive path, as late as the
    channel takes KV transfers (ranks/pd/channel.py: saturated dies hold it delay_s)."""

    def __init__(self, comm, channel) -> None:
        self.comm, self.channel = comm, channel
        self.held: list[tuple[float, Probe]] = []  # (time.monotonic() due, dummy)
        self.sends: list[MPI.Request] = []

    def step(self) -> None:
        now = time.monotonic()
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_PROBE)) is not None:
            self.held.append((now + self.channel.delay_s(), msg.recv()))
        for _, probe in [h for h in self.held if h[0] <= now]:
            self.sends.append(self.comm.isend(probe, dest=probe.prefill, tag=TAG_PD_ECHO))
        self.held = [h for h in self.held if h[0] > now]
        self.sends = [r for r in self.sends if not r.Test()]

    def close(self, *, timeout_s: float) -> None:
        """Dummies still held are dropped (the run is over); the echoes sent complete within
        `timeout_s`."""
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_PROBE)) is not None:
            msg.recv()
        wait_all(
            self.sends, timeout_s=timeout_s, me=f"die rank {self.comm.rank}", event="probe echoes"
        )
