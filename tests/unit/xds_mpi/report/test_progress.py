"""The TE-shell's progress (xds_mpi/report/progress.py): a bar rewritten in place on a terminal,
plain log lines otherwise."""

from __future__ import annotations

import io
import logging

from xds_mpi.report.progress import Progress, Snapshot, format_bar, format_line, progress_mode

HALF = Snapshot(done=2, total=8, tokens=64, max_tokens=128, running=6, queued=0, elapsed_s=2.0)


def test_the_bar_shows_requests_rate_and_eta():
    # 64 of 128 tokens in 2 s: 32 tok/s, 64 tokens left -> 2 s; half the bar filled.
    assert format_bar(HALF) == f"[{'#' * 12}{'.' * 12}] 2/8 requests, 32.0 tok/s, ETA 2.0 s"
    assert format_line(HALF) == (
        "progress: 2/8 requests done, 64 tokens, 32.0 tok/s, 6 running, 0 queued, 2.0 s, ETA 2.0 s"
    )
    idle = Snapshot(done=0, total=8, tokens=0, max_tokens=128, running=8, queued=0, elapsed_s=1)
    assert format_bar(idle).endswith("ETA -")


def test_a_terminal_gets_one_line_rewritten_in_place():
    out = io.StringIO()
    progress = Progress(logging.getLogger("test"), mode="bar", out=out)
    progress.show(HALF)
    progress.show(HALF)
    progress.close()
    assert out.getvalue() == 2 * ("\r\033[K" + format_bar(HALF)) + "\n"


def test_logs_get_plain_lines(caplog):
    out = io.StringIO()
    progress = Progress(logging.getLogger("test"), mode="lines", out=out)
    with caplog.at_level(logging.INFO, logger="test"):
        progress.show(HALF)
    progress.close()
    assert out.getvalue() == ""
    assert caplog.messages == [format_line(HALF)]


def test_the_mode_follows_the_terminal_and_ci(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("CI", raising=False)
    assert progress_mode(Tty()) == "bar"
    assert progress_mode(io.StringIO()) == "lines"
    monkeypatch.setenv("CI", "true")
    assert progress_mode(Tty()) == "lines"
