"""Disaggregated MoE-attention on the virtual clock (docs/virtual_time.md#afd): `xds-mpi run afd`
picks it by default (PD+afd stays on wall), every die of an iteration starts it at the dies'
common virtual start (a crafted burst queues in waves whose first tokens sit where the first
wave's did, domain by domain), the same run gives the same virtual times beside busy processes,
and an hour's idle gap is warped over; `--check` in every run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from harness import busy_processes
from test_serving import check_line
from test_serving_afd import serve
from test_virtual_time import _virtual_columns

from xds_mpi.config.schema import load_config
from xds_mpi.plan.clock import serving_clock


def _jsonl(tmp_path, lines: list[dict]) -> list[str]:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ["--set", "workload.source=jsonl", "--set", f"workload.path={path}"]


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_virtual_is_afd_s_default_pd_afd_s_too():
    def clock(config, *sets):
        return serving_clock(load_config(f"configs/{config}.yaml", list(sets)))

    assert clock("afd").kind == "virtual" and clock("afd", "run.clock=virtual").is_virtual
    assert clock("afd", "run.clock=wall").kind == "wall"
    assert clock("afd", "serve.enabled=true").kind == "wall"  # xds-mpi serve: wall for good
    assert clock("pd_afd").kind == "virtual"  # PD's decode TE-shell grants the attention dies


def test_a_burst_queues_in_waves_each_started_at_the_dies_common_start(tmp_path):
    # 8 equal requests at t=0 on 4 attention dies (2 domains taking turns) of one batch slot:
    # 2 waves. The second starts on every die at one virtual time, the latest clock after the
    # first (domain 1's dies, served after domain 0's at every layer, end last), and each die
    # then runs the same iterations as in the first wave, so a request's first token comes as
    # long after its admission as that die's first-wave request's did.
    lines = [{"prompt_ids": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 4}] * 8
    result, run_file = serve(
        tmp_path,
        *_jsonl(tmp_path, lines),
        *_sets("scheduler.max_batch_per_die=1", "workload.ignore_eos=true"),
    )
    _ok(result)
    assert check_line(result) == "check: 8 requests, 32 tokens, 0 mismatches"
    v = {name: run_file[f"virtual/{name}"][()] for name in run_file["virtual"]}
    die_of = list(run_file["requests/die_rank"][()])
    first, second = range(4), range(4, 8)
    assert sorted(die_of[i] for i in first) == sorted(die_of[i] for i in second) == [1, 2, 3, 4]
    assert list(v["admitted_s"][:4]) == [0.0] * 4
    start = v["admitted_s"][4]
    assert start > 0 and list(v["admitted_s"][4:]) == [start] * 4  # one common start
    assert start == max(v["finish_s"][:4])  # the latest clock: no die's work left behind
    assert min(v["finish_s"][:4]) < start  # domain 0's dies ended earlier: they waited
    after_admission = {die_of[i]: v["first_token_s"][i] - v["admitted_s"][i] for i in first}
    for i in second:
        assert v["first_token_s"][i] - start == pytest.approx(after_admission[die_of[i]], rel=1e-9)
    # Each second-wave request was decided at the finish that freed its slot.
    assert sorted(v["decided_s"][4:]) == pytest.approx(sorted(v["finish_s"][:4]), rel=1e-15)
    assert run_file["summary"].attrs["serving_clock"] == "virtual"


def test_the_same_afd_run_gives_the_same_virtual_times_beside_busy_processes(tmp_path):
    workload = _sets(
        "workload.num_requests=12",
        "workload.arrival=rate",
        "workload.rate_per_s=40",
        "workload.length_dist=uniform",
        "workload.prompt_len=12",
        "workload.max_prompt_len=24",
        "workload.max_output_len=8",
        "workload.output_len=4",
        "scheduler.max_batch_per_die=2",
    )
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = serve(tmp_path / f"run{i}", *workload)
        _ok(result)
        assert check_line(result).endswith(" 0 mismatches")
        runs.append(_virtual_columns(run_file))
    quiet, loaded = runs
    assert quiet.keys() == loaded.keys()
    assert sorted(k for k in quiet if k.startswith("dies/")) == [
        f"dies/{r}/{c}" for r in range(1, 5) for c in ("num_rows", "vtime_s")
    ]
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name
    assert quiet["virtual/queue_s"].max() > 0  # the run queued: the rule was exercised


def test_an_hour_of_idle_time_costs_no_wall_time(tmp_path):
    lines = [
        {"prompt_ids": [5, 6, 7, 8], "max_tokens": 3, "arrival_s": 0.0},
        {"prompt_ids": [9, 10, 11], "max_tokens": 3, "arrival_s": 3600.0},
    ]
    result, run_file = serve(tmp_path, *_jsonl(tmp_path, lines), *_sets("workload.ignore_eos=true"))
    _ok(result)
    assert check_line(result) == "check: 2 requests, 6 tokens, 0 mismatches"
    first_token, queue = run_file["virtual/first_token_s"][()], run_file["virtual/queue_s"][()]
    assert list(queue) == [0.0, 0.0]  # the dies warped to the arrival: admitted at once
    assert 3600.0 < first_token[1] < 3601.0
    # Serving's wall time: the hour is skipped (a wall-paced run would wait it out).
    assert run_file["summary"].attrs["wall_s"] < 60.0
