"""`xds-mpi serve`'s parts that need no live endpoint: refusals before launch, and the text a
stream sends (UTF-8 split across tokens, stop strings split across deltas)."""

from __future__ import annotations

import socket

import pytest

from launch.cli.main import main
from ranks.shell.openai_api import TextOut


def test_serve_refuses_a_busy_port_before_launch(capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port} (serve.host, serve.port)" in err


def test_text_waits_for_a_whole_character():
    text = TextOut(())
    euro = "€".encode()  # 3 bytes, one token each
    assert text.add((euro[0],)) == "" and text.add((euro[1],)) == ""
    assert text.add((euro[2], ord("!"), 257)) == "€!"  # EOS (257) is no text
    assert text.finish() == ""


@pytest.mark.parametrize("cut", range(1, 9))
def test_stop_string_found_across_deltas(cut):
    """However the tokens are split into deltas, the text ends before the stop string and
    nothing after it went out before."""
    data = list(b"abc<END>def")
    text, sent = TextOut(("<END>", "zz")), ""
    for part in (data[:cut], data[cut:]):
        sent += text.add(tuple(part))
        if text.is_stopped:
            break
    assert text.is_stopped and sent == "abc"


def test_text_without_stop_is_whole():
    text = TextOut(("never",))
    sent = text.add(tuple(b"hello wor")) + text.add(tuple(b"ld"))
    assert sent + text.finish() == "hello world"
