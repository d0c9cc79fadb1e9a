"""Virtual-time serving (run.clock virtual, docs/virtual_time.md): the TE-shell's decisions at
virtual arrivals from the state then (xds_mpi/scheduling/admission.py, driven without MPI), and the
colocated run on the dies' virtual clock: queueing known exactly on a crafted burst, an hour's
idle gap warped over, the same virtual times beside busy processes, `--check` in both modes."""

from __future__ import annotations

import json
import math
from collections import deque

import numpy as np
import pytest
from harness import busy_processes
from test_recompute import serve as serve_config
from test_serving import check_line, serve

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.clock import serving_clock
from xds_mpi.results.virtual import VirtualTimes
from xds_mpi.scheduling.admission import Completions, decide, from_words, may_start, to_word
from xds_mpi.scheduling.balancer import DecodeBalancer
from xds_mpi.workload.requests import Request


def _requests(*arrivals: float) -> deque:
    return deque(
        Request(req_id=i, prompt=(1, 2, 3), max_new_tokens=4, arrival_s=a)
        for i, a in enumerate(arrivals)
    )


def _balancer(groups=(1, 2), max_batch=1) -> DecodeBalancer:
    return DecodeBalancer(
        groups, max_batch=max_batch, kv_capacity_tokens=4096, block_tokens=16, mtp_depth=0
    )


# -- the rules, without MPI -----------------------------------------------------------------------
def test_idle_dies_warp_to_the_next_arrival_and_the_horizon_is_the_one_after():
    queue, balancer = _requests(3600.0, 3600.0, 7200.0), _balancer(max_batch=8)
    grant = decide(queue, balancer, Completions(), now_s=None, after_s=0.0, idle_s=0.5)
    assert grant.warp_s == 3600.0  # every die idle: no wall time spent on the hour
    assert [(d.req.req_id, d.vtime_s) for d in grant.decisions] == [(0, 3600.0), (1, 3600.0)]
    assert grant.horizon_s == 7200.0 and [r.req_id for r in queue] == [2]


def test_busy_dies_decide_only_what_arrived_before_their_common_start():
    queue, balancer = _requests(0.0, 0.25, 0.5), _balancer(max_batch=8)
    grant = decide(queue, balancer, Completions(), now_s=0.3, after_s=0.0)
    assert [d.vtime_s for d in grant.decisions] == [0.0, 0.25]
    assert grant.horizon_s == 0.5 and grant.warp_s == -math.inf
    assert may_start(0.49, grant.horizon_s) and not may_start(0.5, grant.horizon_s)


def test_a_full_balancer_decides_at_the_finish_that_frees_a_slot_not_before():
    queue, balancer = _requests(0.0, 0.0, 0.0, 0.1, 0.5), _balancer()
    first = decide(queue, balancer, Completions(), now_s=None, after_s=0.0)
    assert [(d.group, d.vtime_s) for d in first.decisions] == [(1, 0.0), (2, 0.0)]
    # Blocked: the dies may run one more iteration (a finish may free a slot at its end).
    assert first.horizon_s == math.nextafter(0.0, math.inf)
    done = Completions()
    done.add(0, 0.3)  # group 1's request finishes at 0.3, group 2's at 0.2
    done.add(1, 0.2)
    second = decide(queue, balancer, done, now_s=0.3, after_s=0.0)
    # Request 2 takes the slot group 2 frees at 0.2; request 3 (arrived at 0.1) waits for the
    # next one, group 1's at 0.3; request 4 arrives after the dies' start.
    assert [(d.req.req_id, d.group, d.vtime_s) for d in second.decisions] == [
        (2, 2, 0.2),
        (3, 1, 0.3),
    ]
    assert second.horizon_s == 0.5 and len(done) == 0


def test_the_balancer_sees_the_state_at_the_arrival_not_the_finishes_reported_later():
    queue, balancer = _requests(0.0, 0.1), _balancer(max_batch=8)
    decide(queue, balancer, Completions(), now_s=0.0, after_s=0.0)  # request 0 -> group 1
    done = Completions()
    done.add(0, 0.2)  # reported by now, but at 0.1 request 0 still held group 1
    grant = decide(queue, balancer, done, now_s=0.3, after_s=0.0)
    assert [(d.group, d.vtime_s) for d in grant.decisions] == [(2, 0.1)]
    assert len(done) == 1  # not applied yet: its virtual time has not come for any decision


def test_virtual_times_travel_in_agreement_words_bit_for_bit():
    times = [0.0, 1e-9, 0.1 + 0.2, 3600.000000123, math.inf]
    words = np.array([to_word(t) for t in times])
    assert list(from_words(words)) == times
    assert list(np.argsort(words)) == list(range(len(times)))  # ordered as the times
    with pytest.raises(ValueError, match="must be >= 0"):
        to_word(-1.0)


def test_a_request_s_metrics_on_the_virtual_clock():
    t = VirtualTimes(
        req_id=0,
        arrival_s=1.0,
        decided_s=1.5,
        admitted_s=2.0,
        first_token_s=2.25,
        finish_s=3.25,
        num_tokens=5,
    )
    assert (t.queue_s, t.ttft_s, t.tpot_s, t.e2e_s) == (1.0, 1.25, 0.25, 2.25)


def test_virtual_is_the_colocated_run_s_default_and_refused_where_not_built():
    def clock(config, *sets):
        return serving_clock(load_config(f"configs/{config}.yaml", list(sets)))

    assert clock("colocated").kind == "virtual"
    assert clock("colocated", "run.clock=wall").kind == "wall"
    serve_clock = clock("colocated", "serve.enabled=true")
    assert serve_clock.kind == "wall" and "xds-mpi serve" in serve_clock.why
    assert clock("pd").kind == "virtual"  # the JE and the decode TE-shell pace (pd_pacers.py)
    assert clock("pd_afd").kind == "virtual"  # afd decode dies too
    assert clock("pd", "faults.rate=0.001").kind == "wall"
    for config, sets, named in (
        ("pd", ["faults.rate=0.001"], "PD with faults"),
        ("pd", ["deployment.num_host_ranks=1"], "without a decode TE-shell rank"),
        ("colocated", ["serve.enabled=true"], "serve.enabled"),
    ):
        with pytest.raises(ConfigError, match=r"run\.clock\(virtual\)") as refused:
            clock(config, "run.clock=virtual", *sets)
        assert named in str(refused.value)


# -- colocated runs on the virtual clock ----------------------------------------------------------
def _jsonl(tmp_path, lines: list[dict]) -> list[str]:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ["--set", "workload.source=jsonl", "--set", f"workload.path={path}"]


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def test_a_burst_queues_in_waves_of_exactly_one_wave_s_virtual_time(tmp_path):
    # 6 equal requests at t=0 on 2 dies of one batch slot each: 3 waves, each the same
    # iterations at the same positions, so wave k is admitted at k x the first wave's span.
    lines = [{"prompt_ids": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 4}] * 6
    result, run_file = serve(
        tmp_path,
        *_jsonl(tmp_path, lines),
        *_sets(
            "deployment.dp_groups_per_domain=2",
            "scheduler.max_batch_per_die=1",
            "workload.ignore_eos=true",
        ),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 6 requests, 24 tokens, 0 mismatches"
    v = {name: run_file[f"virtual/{name}"][()] for name in run_file["virtual"]}
    assert list(v["req_id"]) == list(range(6))
    span = v["admitted_s"][2]
    assert span > 0 and v["admitted_s"][3] == span  # both slots free at the wave's end
    for req_id in range(6):
        wave = req_id // 2
        assert v["queue_s"][req_id] == pytest.approx(wave * span, rel=1e-12, abs=0)
        assert v["ttft_s"][req_id] == pytest.approx(wave * span + v["ttft_s"][0], rel=1e-12)
        assert v["e2e_s"][req_id] == pytest.approx((wave + 1) * span, rel=1e-12)
    # The second wave's requests were decided at the finishes that freed their slots.
    assert sorted(v["decided_s"][2:4]) == pytest.approx(sorted(v["finish_s"][0:2]), rel=1e-15)
    assert max(v["finish_s"][0:2]) == span  # admitted at the dies' common start after them
    summary = run_file["summary"].attrs
    assert summary["serving_clock"] == "virtual"
    assert summary["virtual_queue_ms_p50"] == pytest.approx(span * 1e3, rel=1e-9)
    assert "virtual clock (910C, queueing included)" in result.stdout + result.stderr


def test_an_hour_of_idle_time_costs_no_wall_time(tmp_path):
    lines = [
        {"prompt_ids": [5, 6, 7, 8], "max_tokens": 3, "arrival_s": 0.0},
        {"prompt_ids": [9, 10, 11], "max_tokens": 3, "arrival_s": 3600.0},
    ]
    result, run_file = serve(tmp_path, *_jsonl(tmp_path, lines), *_sets("workload.ignore_eos=true"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 2 requests, 6 tokens, 0 mismatches"
    first_token, queue = run_file["virtual/first_token_s"][()], run_file["virtual/queue_s"][()]
    assert list(queue) == [0.0, 0.0]  # the dies warped to the arrival: admitted at once
    assert 3600.0 < first_token[1] < 3601.0
    assert run_file["summary"].attrs["wall_s"] < 3.0  # serving's wall time, both requests


def _virtual_columns(run_file) -> dict[str, np.ndarray]:
    columns = {f"virtual/{k}": run_file[f"virtual/{k}"][()] for k in run_file["virtual"]}
    for die in run_file["dies"]:
        columns[f"dies/{die}/vtime_s"] = run_file[f"dies/{die}/vtime_s"][()]
        columns[f"dies/{die}/num_rows"] = run_file[f"dies/{die}/num_rows"][()]
    tokens = run_file["requests/tokens"][()]
    columns["tokens"] = np.concatenate([np.asarray(t) for t in tokens])
    return columns


def test_the_same_config_gives_the_same_virtual_times_beside_busy_processes(tmp_path):
    workload = _sets(
        "workload.num_requests=16",
        "workload.arrival=rate",
        "workload.rate_per_s=40",
        "workload.length_dist=uniform",
        "workload.max_prompt_len=32",
        "workload.max_output_len=12",
        "workload.output_len=4",
    )
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = serve(tmp_path / f"run{i}", *workload)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert check_line(result).endswith(" 0 mismatches")
        runs.append(_virtual_columns(run_file))
    quiet, loaded = runs
    assert quiet.keys() == loaded.keys()
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name
    assert quiet["virtual/queue_s"].max() > 0  # the run queued: the rule was exercised


def test_the_wall_clock_still_drives_serving_when_asked(tmp_path):
    result, run_file = serve(
        tmp_path,
        *_sets(
            "run.clock=wall",
            "workload.num_requests=4",
            "workload.output_len=4",
            "workload.prompt_len=8",
            "workload.ignore_eos=true",
        ),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 4 requests, 16 tokens, 0 mismatches"
    assert "serving clock: wall (run.clock=wall)" in result.stdout + result.stderr
    assert run_file["summary"].attrs["serving_clock"] == "wall"
    assert "virtual" not in run_file


def _eplb_columns(run_file) -> dict[str, np.ndarray]:
    """The virtual columns and EPLB's per-slice record: the placement version each slice began
    and ended with and its loading iterations say at which iterations the swaps ran."""
    columns = _virtual_columns(run_file)
    for name in ("version_start", "version_end", "num_loading", "num_iterations", "moe_s"):
        columns[f"eplb/slice_{name}"] = run_file[f"eplb/slice_{name}"][()]
    columns["eplb/reconfig_after_slice"] = run_file["eplb/reconfig_after_slice"][()]
    return columns


def test_eplb_swaps_at_the_same_iterations_beside_busy_processes(tmp_path):
    # configs/eplb.yaml: 8 dies, a rebalance after every 2 slices of 8 iterations.
    workload = [
        "workload.num_requests=16",
        "workload.arrival=rate",
        "workload.rate_per_s=40",
        "workload.output_len=48",
        "workload.max_output_len=48",
    ]
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = serve_config(tmp_path / f"run{i}", "eplb", workload)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert check_line(result).endswith(" 0 mismatches")
        assert run_file["summary"].attrs["serving_clock"] == "virtual"
        runs.append(_eplb_columns(run_file))
    quiet, loaded = runs
    assert quiet.keys() == loaded.keys()
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name
    assert len(quiet["eplb/reconfig_after_slice"]) >= 2  # placements were swapped in
    assert quiet["eplb/slice_num_loading"].sum() > 0
