"""`xds-mpi serve`'s parts that need no live endpoint: refusals before launch, and the text a
stream sends (UTF-8 split across tokens, stop strings split across deltas), and what the serving
loop's side of the endpoint keeps per request."""

from __future__ import annotations

import socket

import pytest

from launch.cli.main import main
from ranks.shell.endpoint import EndpointFeed
from ranks.shell.openai_api import TextOut
from xds_mpi.results.results import RequestRecord
from xds_mpi.workload.requests import Request


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


class _Endpoint:
    cfg = None

    def __init__(self) -> None:
        self.deltas: list = []

    def publish(self, deltas) -> None:
        self.deltas += deltas


class _Frontend:
    def __init__(self, records) -> None:
        self.records, self.touched = records, set()

    def projected_times(self, req_id):
        return float("nan"), float("nan")

    def prefill_rank(self, req_id):
        return -1


def test_the_feed_keeps_nothing_for_a_request_once_its_last_delta_went_out():
    """Whatever the number of requests served, the serving loop's side of the endpoint holds
    only the open ones (it kept a count per request ever served); the deltas are unchanged."""
    records = {
        i: RequestRecord(req=Request(req_id=i, prompt=(1, 2), max_new_tokens=2, arrival_s=0.0))
        for i in range(1000)
    }
    endpoint, frontend = _Endpoint(), _Frontend(records)
    feed = EndpointFeed(endpoint, frontend, None, deadline=0.0)
    for i, record in records.items():
        for token in (65, 66):
            record.add_token(token, wall_time=1.0)
            frontend.touched.add(i)
            if token == 66:
                record.finished_at = 2.0
                record.compact()
            feed.publish()
        assert len(feed.num_published) == 0
    assert [(d.req_id, d.tokens, d.finish_reason) for d in endpoint.deltas[:2]] == [
        (0, (65,), ""),
        (0, (66,), "length"),
    ]
    assert len(endpoint.deltas) == 2000 and len(feed.num_published) == 0
    # while one is open its count stays
    records[5].finished_at, records[5].tokens = 0.0, [65]
    frontend.touched.add(5)
    feed.publish()
    assert feed.num_published == {5: 1}
