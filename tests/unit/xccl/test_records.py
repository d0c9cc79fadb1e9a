"""The metadata record, publish / ready / wait on a one-rank window (COMM_SELF), the p2p ack word,
and the combine sum dispatch/combine and A2E/E2A share."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from xccl import records
from xccl.ep.buffer import EpBuffer
from xccl.errors import EventMismatch, XcclTimeout
from xccl.gmem import DieMemory
from xccl.layout import RECORD_BYTES
from xccl.moe_layout import EpLayout
from xccl.records import P2P_RECORD, ROWS_RECORD, Expected, RecordAt
from xccl.records.record import evenly_spaced
from xccl.routing import combine_weights, weighted_column_sum

SENTINEL = 0xA5


def test_records_are_one_64_byte_layout_with_the_doorbell_first():
    for dtype in (P2P_RECORD, ROWS_RECORD):
        assert dtype.itemsize == RECORD_BYTES
        assert dtype.fields["doorbell"][1] == records.DOORBELL_OFFSET == 0
        assert dtype.fields["event_id"][1] == 8 and dtype.fields["vtime_ns"][1] == 32
    assert [
        P2P_RECORD.fields[n][1]
        for n in ("chunk_id", "tail", "msg_bytes", "pub_bytes", "num_cores", "is_dma")
    ] == [16, 24, 40, 48, 56, 60]
    assert [
        ROWS_RECORD.fields[n][1] for n in ("count", "offset", "shared_count", "shared_offset")
    ] == [16, 24, 40, 48]
    # What AfdCounters.metadata_bytes counts per record: six body words and the doorbell.
    assert records.put_bytes(ROWS_RECORD) == 56 and records.put_bytes(P2P_RECORD) == 64


@pytest.fixture
def mem():
    """A one-rank window of three records; every byte a sentinel so overruns show."""
    window = DieMemory(MPI.COMM_SELF, 3 * RECORD_BYTES)
    window.local[:] = SENTINEL
    for offset in (0, RECORD_BYTES, 2 * RECORD_BYTES):
        window.local[offset : offset + 8] = 0  # doorbells start un-rung
    yield window
    window.free()


def rows_bodies(event_id: int, counts: list[int]) -> np.ndarray:
    bodies = np.zeros(len(counts), ROWS_RECORD)
    bodies["event_id"], bodies["count"] = event_id, counts
    bodies["offset"] = np.cumsum(counts) - counts
    bodies["shared_count"], bodies["vtime_ns"] = 1, 1234.5
    return bodies


def test_publish_then_ready_returns_the_bodies_field_by_field(mem):
    at = [RecordAt(0, 0), RecordAt(0, RECORD_BYTES)]
    expected = Expected(stage="dispatch", event_id=9, doorbell=3, call="call 3")
    assert records.ready(mem, at, expected, ROWS_RECORD) is None
    assert records.missing_peers(mem, at, 3) == [0, 0]
    records.publish(mem, at, rows_bodies(9, [4, 2]), 3)
    got = records.ready(mem, at, expected, ROWS_RECORD)
    assert got["doorbell"].tolist() == [3, 3] and got["event_id"].tolist() == [9, 9]
    assert got["count"].tolist() == [4, 2] and got["offset"].tolist() == [0, 4]
    assert got["shared_count"].tolist() == [1, 1] and got["vtime_ns"].tolist() == [1234.5] * 2
    # The padding after the last field and the third record were never written.
    pad = np.arange(records.put_bytes(ROWS_RECORD), RECORD_BYTES)
    assert (mem.local[pad] == SENTINEL).all() and (mem.local[RECORD_BYTES + pad] == SENTINEL).all()
    assert (mem.local[2 * RECORD_BYTES + 8 :] == SENTINEL).all()


@pytest.mark.parametrize("spaced", [True, False])
def test_a_fan_out_writes_each_readers_body_and_doorbell_and_nothing_else(mem, spaced):
    """Readers' records side by side are written through one strided view, else one by one;
    either way each reader gets its own body, then the doorbell, and no other byte changes."""
    at = [RecordAt(0, 0), RecordAt(0, RECORD_BYTES), RecordAt(0, 2 * RECORD_BYTES)]
    if not spaced:
        at = [at[0], at[2], at[1]]  # out of order: no one stride
    fan = records.FanOut.records(mem, at, ROWS_RECORD)
    assert (fan._near_block is not None) == spaced and (fan._bell_block is not None) == spaced
    expected = Expected(stage="dispatch", event_id=9, doorbell=5, call="call 5")
    bodies = rows_bodies(9, [4, 2, 7])
    fan.publish(bodies.view(np.uint8).reshape(3, RECORD_BYTES), 5)
    got = records.ready(mem, at, expected, ROWS_RECORD)
    assert got["doorbell"].tolist() == [5, 5, 5] and got["count"].tolist() == [4, 2, 7]
    pad = np.arange(records.put_bytes(ROWS_RECORD), RECORD_BYTES)
    for record in range(3):
        assert (mem.local[record * RECORD_BYTES + pad] == SENTINEL).all()
    fan.publish(bodies.view(np.uint8).reshape(3, RECORD_BYTES)[1], 6)  # one body for all
    again = Expected(stage="dispatch", event_id=9, doorbell=6, call="call 6")
    got = records.ready(mem, at, again, ROWS_RECORD)
    assert got["count"].tolist() == [2, 2, 2]


def test_evenly_spaced_views_only_when_one_stride_reaches_them_all():
    block = np.zeros((4, 16), np.uint8)
    rows = [block[i, 2:10] for i in range(4)]
    view = evenly_spaced(rows)
    view[:] = np.arange(4)[:, None] + 1
    assert view.shape == (4, 8) and (block[:, 2:10] == np.arange(1, 5)[:, None]).all()
    assert (block[:, :2] == 0).all() and (block[:, 10:] == 0).all()
    uneven = [block[0, :8], block[1, :8], block[3, :8]]
    assert evenly_spaced(uneven) is None
    assert evenly_spaced(rows[::-1]) is None  # descending: left to the loop
    assert evenly_spaced([block[0, :8], block[0, 4:12]]) is None  # overlapping
    assert evenly_spaced(rows[:1]) is None


def test_an_old_doorbell_is_not_ready_and_a_foreign_event_is_named(mem):
    at = [RecordAt(0, 0)]
    records.publish(mem, at, rows_bodies(7, [1]), 2)
    assert (
        records.ready(
            mem, at, Expected(stage="A2E", event_id=7, doorbell=3, call="call 2"), ROWS_RECORD
        )
        is None
    )
    with pytest.raises(EventMismatch) as err:
        records.ready(
            mem, at, Expected(stage="A2E", event_id=8, doorbell=2, call="call 1"), ROWS_RECORD
        )
    assert str(err.value) == "die rank 0: A2E expected event 8, rank 0 reported event 7 (call 1)"


def test_wait_times_out_naming_die_stage_event_call_and_missing_peers(mem):
    at = [RecordAt(0, 0), RecordAt(0, RECORD_BYTES)]
    records.publish(mem, at[:1], rows_bodies(5, [1]), 1)
    turns = []
    with pytest.raises(XcclTimeout) as err:
        records.wait(
            mem,
            at,
            Expected(stage="combine", event_id=5, doorbell=1, call="call 1"),
            ROWS_RECORD,
            timeout_s=0.05,
            interrupt=lambda: turns.append(1),
        )
    assert str(err.value) == (
        "die rank 0: combine event 5 (call 1): no record from rank(s) [0] after 0.05 s"
    )
    assert turns, "the interrupt is called on every turn of the wait"


def test_p2p_body_round_trips_through_a_record(mem):
    body = np.zeros(1, P2P_RECORD)
    body["event_id"], body["chunk_id"], body["tail"], body["vtime_ns"] = 4, 8, 12, 99.0
    body["msg_bytes"], body["pub_bytes"], body["num_cores"], body["is_dma"] = 1 << 40, 64, 48, 1
    records.publish(mem, [RecordAt(0, 2 * RECORD_BYTES)], body, 6)
    got = records.ready(
        mem,
        [RecordAt(0, 2 * RECORD_BYTES)],
        Expected(stage="receive", event_id=4, doorbell=6, call="publication 6"),
        P2P_RECORD,
    )[0]
    assert got["doorbell"] == 6 and got.tolist()[1:] == body[0].tolist()[1:]


@pytest.mark.parametrize("seq", [1, 65535, 65536, 1 << 20])
def test_the_ack_word_carries_publication_and_time_and_wraps(seq):
    word = records.ack_word(seq, 123456.7)
    assert records.ack_time_ns(word) == 123456.0
    assert records.ack_covers(word, seq) and records.ack_covers(word, seq - 1)
    assert not records.ack_covers(word, seq + 1)


def test_combine_weights_and_the_column_sum_follow_the_longhand_sum():
    rng = np.random.default_rng(3)
    topk_idx = np.array([[0, -1], [2, 1], [-1, -1]])
    topk_weights = rng.random((3, 2)).astype(np.float32)
    weights = combine_weights(topk_idx, topk_weights, 3)  # [T, C], shared last
    assert weights.dtype == np.float64
    assert weights[:, 2].tolist() == [1.0, 1.0, 1.0] and weights[0, 1] == weights[2, 0] == 0.0
    token, column = np.nonzero(np.concatenate([topk_idx >= 0, np.ones((3, 1), bool)], axis=1))
    order = rng.permutation(len(token))  # arrival order
    token, column = token[order], column[order]
    outs = (rng.standard_normal((len(token), 4)) + 10 * token[:, None]).astype(np.float32)
    y = weighted_column_sum(outs, token, column, weights)
    want = np.zeros((3, 4))
    for t in range(3):
        for c in range(3):
            for r in np.flatnonzero((token == t) & (column == c)):
                want[t] = want[t] + weights[t, c] * outs[r].astype(np.float64)
    assert y.dtype == np.float64 and np.array_equal(y, want)


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 17, 40])  # one block (<= 16) and several
def test_the_column_sum_adds_each_tokens_columns_in_order_whatever_the_arrival(num_tokens):
    rng = np.random.default_rng(num_tokens)
    num_columns = 3
    present = rng.random((num_tokens, num_columns)) < 0.7  # some columns without a row
    token, column = np.nonzero(present)
    order = rng.permutation(len(token))
    token, column = token[order], column[order]
    outs = rng.standard_normal((len(token), 8)).astype(np.float32)
    weights = rng.random((num_tokens, num_columns))
    want = np.zeros((num_tokens, 8))
    for c in range(num_columns):  # longhand: column by column from zero
        for r in np.flatnonzero(column == c):
            want[token[r]] = want[token[r]] + weights[token[r], c] * outs[r].astype(np.float64)
    assert np.array_equal(weighted_column_sum(outs, token, column, weights), want)


def test_an_ep_buffer_refuses_rows_of_another_itemsize():
    layout = EpLayout(
        members=(0,), base=(0,), hidden=4, max_tokens=2, num_columns=1, itemsize=8, use_int8=False
    )
    mem = DieMemory(MPI.COMM_SELF, layout.area_bytes())
    with pytest.raises(
        ValueError,
        match=r"rank 0: dtype float32 of itemsize 4 != the EP "
        r"layout's itemsize 8",
    ):
        EpBuffer(mem, layout, [0], dtype=np.float32)
    assert EpBuffer(mem, layout, [0], dtype=np.float64).dtype == np.float64
    mem.free()


@pytest.mark.parametrize("few_words", [32, 0])
def test_a_poll_names_the_words_not_rung_the_same_on_either_path(mem, monkeypatch, few_words):
    """WordPoll reads a few words one by one and many with numpy: the same indices."""
    from xccl.records import record

    monkeypatch.setattr(record, "FEW_WORDS", few_words)
    offsets = [0, RECORD_BYTES, 2 * RECORD_BYTES]
    poll = record.WordPoll(mem, offsets, [0, 0, 0])
    assert poll.missing(3) == [0, 1, 2]
    mem.store_word(0, RECORD_BYTES, 3)
    assert poll.missing(3) == [0, 2]
    mem.store_word(0, 0, 3)
    mem.store_word(0, 2 * RECORD_BYTES, 4)  # another value is not the one waited for
    assert poll.missing(3) == [2]
    mem.store_word(0, 2 * RECORD_BYTES, 3)
    assert poll.missing(3) == []
    # Within a wait only the words the last try missed are read again (a rung word stays rung).
    assert poll.missing(5, [0, 1, 2]) == [0, 1, 2]
    mem.store_word(0, 0, 5)
    assert poll.missing(5, [0, 1, 2]) == [1, 2]
    mem.store_word(0, RECORD_BYTES, 5)
    assert poll.missing(5, [1, 2]) == [2]
    if few_words:  # the list path reads word 0 no more: it rang; numpy's reads all words
        assert poll.missing(5, [0]) == []
