"""A served run's record cap (ranks/shell/serve_records.py): past max_records finished records
the oldest quarter goes, counted; with --check it is first compared with the reference in the
checker process, so every request is still checked (a wrong token among those let go is
found); cancelled records stay."""

from __future__ import annotations

import logging

import pytest

from ranks.shell.serve_records import RecordCap
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import load_config
from xds_mpi.model.moe import Wire
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.weights import build_model
from xds_mpi.results.failures import FailureRecord
from xds_mpi.results.record_cap import MAX_RECORDS_ENV, max_records
from xds_mpi.results.results import RequestRecord, check_against_reference
from xds_mpi.workload.requests import Request

MAX_NEW = 4


@pytest.fixture(scope="module")
def cfg():
    return load_config(resolve_config("colocated"), ["run.check=true", "workload.ignore_eos=true"])


@pytest.fixture(scope="module")
def served(cfg):
    """8 requests as a die would serve them: the reference's own tokens."""
    records = {
        i: RequestRecord(
            req=Request(req_id=i, prompt=(256, 40 + i, 50 + i), max_new_tokens=MAX_NEW)
        )
        for i in range(8)
    }
    wire = Wire.for_config(cfg)
    options = GenerateOptions(  # as check_against_reference runs it
        max_new_tokens=MAX_NEW,
        mtp_depth=cfg.scheduler.mtp_depth,
        use_int8=cfg.xccl.use_int8,
        ignore_eos=True,
        block_tokens=cfg.scheduler.kv_block_tokens,
        kv_int8=cfg.scheduler.kv_int8,
        row_dtype=wire.row_dtype,
        shared_path=wire.shared,
    )
    outputs = ReferenceGenerator(build_model(cfg.model), options).generate(
        [list(r.req.prompt) for r in records.values()]
    )
    for record, out in zip(records.values(), outputs):
        record.tokens = list(out.tokens)
        record.finished_at = 1.0
    return records


def _fresh(served: dict, *, wrong: int = -1) -> dict:
    out = {}
    for i, r in served.items():
        tokens = list(r.tokens)
        if i == wrong:
            tokens[2] = (tokens[2] + 1) % 256
        out[i] = RequestRecord(req=r.req, tokens=tokens, finished_at=r.finished_at)
    return out


def _serve_through_cap(cfg, records: dict, max_records: int) -> tuple[RecordCap, dict]:
    cap = RecordCap(cfg, max_records, logging.getLogger("test"))
    kept = {}
    for req_id, record in records.items():  # each finishes and is published, then a turn ends
        kept[req_id] = record
        cap.note_finished(req_id)
        cap.trim(kept)
    return cap, kept


def test_the_oldest_go_and_every_request_is_still_checked(cfg, served):
    cap, kept = _serve_through_cap(cfg, _fresh(served, wrong=1), max_records=4)
    assert sorted(kept) == [4, 5, 6, 7]  # the newest 4
    assert cap.num_dropped == 4 and cap.num_dropped_tokens == 4 * MAX_NEW
    totals = cap.finish()
    num_requests, num_tokens, mismatches = check_against_reference(cfg, kept)
    assert (totals.num_requests + num_requests, totals.num_tokens + num_tokens) == (8, 32)
    assert mismatches == []
    assert totals.mismatches == ["request 1: token 2 differs (4 tokens served, 4 in the reference)"]


def test_cancelled_records_stay_and_no_cap_keeps_all(cfg, served):
    records = _fresh(served)
    records[0].cancelled = "client gone"
    cap, kept = _serve_through_cap(cfg, records, max_records=4)
    assert 0 in kept and cap.num_dropped == 3  # 1, 2, 3 went; the cancelled 0 stays
    cap.finish()
    cap, kept = _serve_through_cap(cfg, _fresh(served), max_records=0)
    assert len(kept) == 8 and cap.num_dropped == 0 and cap.finish() is None


def test_the_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(MAX_RECORDS_ENV, "250")
    assert max_records() == 250
    monkeypatch.setenv(MAX_RECORDS_ENV, "lots")
    with pytest.raises(ValueError, match="must be a count of records"):
        max_records()


def test_a_failures_tokens_per_s_counts_the_records_let_go(cfg):
    """A fault at 10 s and the dies serving again at 14 s: the 3 s windows either side count
    the tokens of records let go (31 before, 12 after, 0.1 s buckets) on top of the kept's."""
    cap = RecordCap(cfg, 4, logging.getLogger("test"))
    started = 1000.0
    cap.num_dropped = 2
    cap.tokens_gone.add([started + 7.0 + 0.1 * i for i in range(30)])  # 7.0 .. 9.9 s
    cap.tokens_gone.add([started + 9.95, started + 20.0])  # before the fault / in no window
    cap.tokens_gone.add([started + 14.0 + 0.25 * i for i in range(12)])  # 14.0 .. 16.75 s
    assert cap.tokens_gone.count(started + 7.0, started + 10.0) == 31
    record = FailureRecord(
        kind="dead",
        die=1,
        role="colocated",
        injected_iteration=5,
        injected_wall_s=10.0,
        injected_virtual_s=1.0,
        detected_wall_s=12.0,
        resumed_wall_s=14.0,
        tokens_per_s_before=2.0,
        tokens_per_s_after=1.0,
    )
    (out,) = cap.with_rates([record], started)
    assert out.tokens_per_s_before == pytest.approx(2.0 + 31 / 3)
    assert out.tokens_per_s_after == pytest.approx(1.0 + 12 / 3)
