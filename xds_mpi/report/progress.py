"""The TE-shell's progress on a long run: on a terminal one line rewritten in place with a bar,
requests done/total, tokens/s and an ETA; in logs and CI a plain log line every few seconds.

The ranks' output goes through mpiexec's pipes, so a rank cannot see the terminal itself:
`xds-mpi run` tells it (PROGRESS_ENV = "bar" when its own stdout is a terminal outside CI)."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

PROGRESS_ENV = "XDS_MPI_PROGRESS"
LINE_EVERY_S = 1.0  # plain lines
BAR_EVERY_S = 0.2  # the terminal's line
BAR_WIDTH = 24


def progress_mode(stdout=None) -> str:
    """What `xds-mpi run` tells the ranks: "bar" on an interactive terminal, else "lines"."""
    stdout = stdout or sys.stdout
    return "bar" if stdout.isatty() and not os.environ.get("CI") else "lines"


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Where serving stands: requests done of total, tokens out of at most max_tokens (the
    accepted requests' max_new_tokens: EOS can end them earlier), running and queued requests,
    wall seconds since serving started; with run.clock virtual, vtime_s: the dies' virtual
    time reached (the latest token's; -1 on the wall clock)."""

    done: int
    total: int
    tokens: int
    max_tokens: int
    running: int
    queued: int
    elapsed_s: float
    vtime_s: float = -1.0

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.elapsed_s, 1e-9)

    def eta_s(self) -> float:
        """Seconds left at the rate so far (an upper bound: EOS can end requests early)."""
        rate = self.tokens_per_s()
        return (self.max_tokens - self.tokens) / rate if rate > 0 else float("inf")


def format_line(s: Snapshot) -> str:
    return (
        f"progress: {s.done}/{s.total} requests done, {s.tokens} tokens, "
        f"{s.tokens_per_s():.1f} tok/s, {s.running} running, {s.queued} queued, "
        f"{s.elapsed_s:.1f} s, ETA {_eta(s)}{_virtual(s)}"
    )


def _virtual(s: Snapshot) -> str:
    """Virtual time, wall time and their ratio (run.clock virtual), else nothing."""
    if s.vtime_s < 0:
        return ""
    ratio = s.vtime_s / max(s.elapsed_s, 1e-9)
    return f"; virtual {s.vtime_s:.3f} s in {s.elapsed_s:.1f} s wall ({ratio:.2f}x)"


def _eta(s: Snapshot) -> str:
    eta = s.eta_s()
    return f"{eta:.1f} s" if eta != float("inf") else "-"


def format_bar(s: Snapshot) -> str:
    filled = round(BAR_WIDTH * s.tokens / max(s.max_tokens, 1))
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return (
        f"[{bar}] {s.done}/{s.total} requests, {s.tokens_per_s():.1f} tok/s, ETA {_eta(s)}"
        f"{_virtual(s)}"
    )


class Progress:
    def __init__(self, log: logging.Logger, *, mode: str | None = None, out=None) -> None:
        self.log, self.out = log, out or sys.stdout
        self.is_bar = (mode or os.environ.get(PROGRESS_ENV, "lines")) == "bar"
        self.every_s = BAR_EVERY_S if self.is_bar else LINE_EVERY_S
        self.next_s = time.monotonic() + self.every_s
        self.shown = False

    def is_due(self) -> bool:
        return time.monotonic() >= self.next_s

    def show(self, s: Snapshot) -> None:
        self.next_s = time.monotonic() + self.every_s
        if self.is_bar:  # \r and erase: the same line each time
            self.out.write("\r\033[K" + format_bar(s))
            self.out.flush()
            self.shown = True
        else:
            self.log.info(format_line(s))

    def close(self) -> None:
        """End the terminal's line so the next output starts on its own."""
        if self.shown:
            self.out.write("\n")
            self.out.flush()


class Phases:
    """Wall seconds of consecutive phases (the stop: the dies taking it, their reports, ...):
    `end(name)` closes the phase that began where the previous one ended."""

    def __init__(self) -> None:
        self.began = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def describe(self) -> str:
        """One line: each phase with its seconds, then their sum in brackets."""
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.seconds.items())
        return f"{parts} ({self.last - self.began:.2f} s)"
