"""PD on the virtual clock (docs/virtual_time.md "PD"): a lone request's virtual TTFT is exactly
its priced parts (prefill, KV transfer over the pair's link, first decode step), an hour's gap
is warped over, the decode TE-shell holds tasks back while the decode dies' KV is full (no die
defers a receive), the virtual columns are the same beside busy processes, and a decode die lost
for good is failed over on the virtual clock: its request prefilled again at the fault plus the
failover's price, the same beside busy processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from harness import busy_processes
from test_pd_decode_loss import priced_resumption
from test_serving import check_line
from test_serving_pd import explain, serve
from test_virtual_time import _virtual_columns

from xds_mpi.results.failures import read_failures


def _jsonl(tmp_path, lines: list[dict]) -> list[str]:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ["workload.source=jsonl", f"workload.path={path}"]


def test_a_lone_request_s_virtual_ttft_is_its_priced_parts_an_hour_apart(tmp_path):
    lines = [
        {"prompt_ids": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 4, "arrival_s": 0.0},
        {"prompt_ids": [9, 10, 11, 13, 14], "max_tokens": 4, "arrival_s": 3600.0},
    ]
    result, run_file = serve(tmp_path, *_jsonl(tmp_path, lines))
    assert result.returncode == 0, explain(result)
    assert check_line(result) == "check: 2 requests, 8 tokens, 0 mismatches"
    assert "serving clock: virtual" in result.stdout + result.stderr
    v = {name: run_file[f"virtual/{name}"][()] for name in run_file["virtual"]}
    pd = run_file["pd"]
    order = list(pd["req_id"][()])
    for req_id, arrival in ((0, 0.0), (1, 3600.0)):
        i = order.index(req_id)
        parts = {p: pd[f"ttft_{p}_v_s"][()][i] for p in ("queue", "prefill", "kv_transfer")}
        first_step = pd["ttft_first_step_v_s"][()][i]
        assert v["queue_s"][req_id] == 0.0 and parts["queue"] == 0.0  # alone: no queueing
        assert parts["kv_transfer"] > 0 and first_step > 0
        # The prefill TE starts at the arrival, the decode die at the KV's arrival.
        expected = parts["prefill"] + parts["kv_transfer"] + first_step
        assert v["ttft_s"][req_id] == pytest.approx(expected, rel=1e-12), req_id
        assert v["admitted_s"][req_id] == arrival
    assert run_file["summary"].attrs["wall_s"] < 30.0  # an hour's gap warped over


def test_decode_backpressure_on_the_virtual_clock_and_the_same_times_beside_busy_processes(
    tmp_path,
):
    # 1 prefill die -> 2 decode dies whose KV holds 2 requests each (2 blocks of 16 tokens per
    # request: 12 + 6), 10 requests at once: the decode TE-shell grants a task only when its
    # die's slot is free on the virtual clock, so no die ever defers a receive.
    sets = (
        "deployment.num_prefill_dies=1",
        "deployment.dp_groups_per_domain=2",
        "scheduler.num_kv_blocks_per_die=4",
        "workload.num_requests=10",
        "workload.length_dist=fixed",
        "workload.prompt_len=12",
        "workload.output_len=6",
    )
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = serve(tmp_path / f"run{i}", *sets)
        assert result.returncode == 0, explain(result)
        assert check_line(result) == "check: 10 requests, 60 tokens, 0 mismatches"
        assert run_file["summary"].attrs["pd_deferred_receives"] == 0
        assert "joins later than the virtual clock decided" not in result.stdout + result.stderr
        runs.append(_virtual_columns(run_file))
        # At no virtual time does a decode die hold more than its 2 requests' KV: a request
        # holds it from its KV's arrival (before its first decode step) to its last token.
        order = list(run_file["pd/req_id"][()])
        first_step = run_file["pd/ttft_first_step_v_s"][()]
        die = run_file["requests/die_rank"][()]
        v = run_file["virtual"]
        held = [
            (int(die[r]), v["first_token_s"][r] - first_step[order.index(r)], v["finish_s"][r])
            for r in range(10)
        ]
        for d, start, _ in held:
            at_once = [h for h in held if h[0] == d and h[1] <= start < h[2]]
            assert len(at_once) <= 2, (d, start, at_once)
        # 4 slots for 10 requests: they finish in waves of 4, 4 and 2.
        assert sorted(np.unique(v["e2e_s"][()], return_counts=True)[1]) == [2, 4, 4]
    quiet, loaded = runs
    assert quiet.keys() == loaded.keys()
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name


@pytest.mark.failure_matrix
def test_a_decode_die_lost_for_good_fails_over_on_the_virtual_clock_the_same_beside_busy_processes(
    tmp_path,
):
    # configs/pd.yaml (2 prefill dies -> 4 colocated decode dies, ring replicas), decode die 3
    # dead at 0.3 s virtual: its request is prefilled again, arriving when the failover ends.
    # Before, such a run stayed on the wall clock; built first, 2 of 3 runs then ended with a
    # rank killed: the decode TE-shell left the JE's last promise unreceived, and MPI_Finalize
    # failed on it (DecodePacer.finish now takes it).
    health = (
        "health.replicas=ring",
        "deployment.redundant_slots_per_die=4",
        "health.timeout_s=4",
        "health.probe_timeout_s=10",
    )
    sets = (
        "faults.events=[{kind: dead, die: 3, at_s: 0.3}]",
        *health,
        "workload.num_requests=6",
        "workload.output_len=10",
        "workload.max_output_len=10",
    )
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = serve(tmp_path / f"run{i}", *sets)
        assert result.returncode == 0, explain(result)
        assert check_line(result) == "check: 6 requests, 60 tokens, 0 mismatches"
        assert run_file["summary"].attrs["serving_clock"] == "virtual"
        out = result.stdout + result.stderr
        runs.append((_virtual_columns(run_file), read_failures(run_file), out))
    (quiet, [record], out), (loaded, [record_loaded], _) = runs
    assert quiet.keys() == loaded.keys()
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name
    assert record.detected_virtual_s == record_loaded.detected_virtual_s
    assert (record.die, record.verdict) == (3, "dead") and record.requests_affected
    resumed_s = priced_resumption(record, out, "pd", health)
    assert record.injected_virtual_s >= 0.3
    decided = quiet["virtual/decided_s"]
    for req_id in record.requests_affected:  # prefilled again, arriving at the resumption
        assert decided[req_id] == pytest.approx(resumed_s, abs=1e-5), req_id
    assert quiet["virtual/finish_s"].min() > resumed_s  # the survivors waited it out too
