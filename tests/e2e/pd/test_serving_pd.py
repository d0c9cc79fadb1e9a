"""Disaggregated prefill-decode end to end: `xds-mpi run pd --check` equals the single-process
reference (prefill + decode in one process), with the KV cache moved over XCCL p2p; configs PD
cannot run are refused before launch with their numbers.

Each MPI run combines several properties to keep the file short on 2 cores.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT
from test_serving import XDS_MPI, check_line

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.pd.prefill import PrefillStatus, assign
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.workload.requests import Request

PARTS = ("queue", "prefill", "kv_wait", "kv_transfer", "first_step")


def serve(tmp_path: Path, *sets: str) -> tuple[subprocess.CompletedProcess, h5py.File | None]:
    args = [a for s in ("workload.ignore_eos=true", *sets) for a in ("--set", s)]
    result = subprocess.run(
        [str(XDS_MPI), "run", "pd", "--check", "--set", f"run.output_dir={tmp_path}"]
        + ["--set", "run.name=pd", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    path = tmp_path / "pd.h5"
    return result, (h5py.File(path, "r") if path.exists() else None)


def explain(result: subprocess.CompletedProcess) -> str:
    return result.stdout[-4000:] + result.stderr[-4000:]


def test_pd_default_equals_reference_and_splits_ttft(tmp_path):
    # configs/pd.yaml: JE, decode TE-shell, 2 prefill dies (EP2) -> 4 colocated decode dies;
    # uneven prompt lengths.
    result, run_file = serve(
        tmp_path, "workload.num_requests=6", "workload.output_len=5", "workload.max_output_len=5"
    )
    assert result.returncode == 0, explain(result)
    assert check_line(result) == "check: 6 requests, 30 tokens, 0 mismatches"
    pd, requests = run_file["pd"], run_file["requests"]
    assert sorted(pd["req_id"][()]) == list(range(6))  # every request's KV moved over p2p
    assert set(pd["prefill_rank"][()]) <= {6, 7} and set(pd["decode_rank"][()]) <= {2, 3, 4, 5}
    assert list(requests["die_rank"][()]) == [  # the decode TE-shell's choice, as the JE saw it
        int(pd["decode_rank"][()][list(pd["req_id"][()]).index(r)]) for r in range(6)
    ]
    assert (pd["kv_bytes"][()] > 0).all()
    # The wall parts add up to each request's TTFT; the projected ones are all priced.
    ttft = requests["ttft_s"][()][pd["req_id"][()]]
    parts = sum(pd[f"ttft_{p}_s"][()] for p in PARTS)
    assert np.allclose(parts, ttft, atol=1e-6)
    for part in ("queue", "prefill", "kv_transfer", "first_step"):
        assert (pd[f"ttft_{part}_v_s"][()] >= 0).all()
    assert (pd["ttft_prefill_v_s"][()] > 0).all() and (pd["ttft_kv_transfer_v_s"][()] > 0).all()
    assert run_file["summary"].attrs["pd_transfers"] == 6


def test_backpressure_defers_receives_and_loses_nothing(tmp_path):
    # 1 prefill die -> 2 decode dies whose KV holds 2 requests each (2 blocks of 16 tokens per
    # request: 12 + 6), 10 requests at once: decode defers receives, prefill KV fills up too.
    # On the wall clock: on the virtual one the decode TE-shell holds the tasks back instead
    # (tests/e2e/pd/test_pd_virtual_time.py).
    result, run_file = serve(
        tmp_path,
        "run.clock=wall",
        "deployment.num_prefill_dies=1",
        "deployment.dp_groups_per_domain=2",
        "scheduler.num_kv_blocks_per_die=4",
        "workload.num_requests=10",
        "workload.length_dist=fixed",
        "workload.prompt_len=12",
        "workload.output_len=6",
    )
    assert result.returncode == 0, explain(result)
    assert check_line(result) == "check: 10 requests, 60 tokens, 0 mismatches"
    summary = run_file["summary"].attrs
    assert summary["pd_transfers"] == 10
    assert summary["pd_deferred_receives"] > 0
    assert (run_file["pd/num_deferred"][()] > 0).sum() == summary["pd_deferred_receives"]
    assert list(run_file["requests/status"].asstr()[()]) == ["done"] * 10


@pytest.mark.long
def test_mtp_depth_1_two_prefill_tes_of_three_dies_feed_two_decode_dies(tmp_path):
    # prefill TE 0 = ranks 4, 5 (EP2, short prompts), TE 1 = rank 6 (EP1, prompts >= 40 tokens);
    # the prompts are 57, 47, 41 (long) and 29, 31, 18 (short) tokens
    result, run_file = serve(
        tmp_path,
        "scheduler.mtp_depth=1",
        "deployment.num_prefill_dies=3",
        "deployment.dp_groups_per_domain=2",
        "pd.num_prefill_tes=2",
        "pd.long_prompt_tokens=40",
        "workload.num_requests=6",
        "workload.output_len=6",
        "workload.max_output_len=6",
    )
    assert result.returncode == 0, explain(result)
    assert check_line(result) == "check: 6 requests, 36 tokens, 0 mismatches"
    assert "MTP depth 1: acceptance" in result.stdout + result.stderr
    prompt_len = run_file["requests/prompt_len"][()][run_file["pd/req_id"][()]]
    prefill_rank = run_file["pd/prefill_rank"][()]
    assert sorted(prompt_len) == [18, 29, 31, 41, 47, 57]  # every request moved its KV
    assert set(prefill_rank[prompt_len >= 40]) == {6}  # long: TE 1
    assert set(prefill_rank[prompt_len < 40]) <= {4, 5}  # short: TE 0


@pytest.mark.long
def test_one_prefill_die_feeds_six_and_failed_kv_transfers_are_retried(tmp_path):
    # JE only (it balances decode itself), 1 prefill die (rank 7, all 16 experts) -> 6 decode
    # dies; the prefill die's 5th transfer fails twice at the sender; decode die 2's first
    # transfer fails once at the receiver (unless that is the same transfer: then the sender's
    # failures come first and the receiver's row, for attempt 0 only, does not fire).
    faults = (
        "faults.table=[{die: 7, op: p2p_send, layer: 0, iteration: 4, times: 2},"
        " {die: 2, op: p2p_recv, layer: 0, iteration: 0}]"
    )
    result, run_file = serve(
        tmp_path,
        "deployment.num_host_ranks=1",
        "deployment.num_prefill_dies=1",
        "deployment.dp_groups_per_domain=6",
        "workload.num_requests=8",
        "workload.output_len=4",
        "workload.max_output_len=4",
        faults,
    )
    assert result.returncode == 0, explain(result)
    assert check_line(result) == "check: 8 requests, 32 tokens, 0 mismatches"
    summary = run_file["summary"].attrs
    assert summary["pd_send_faults"] == 2 and summary["pd_recv_faults"] <= 1
    assert summary["pd_retries"] == summary["pd_send_faults"] + summary["pd_recv_faults"]
    assert summary["pd_retries"] == run_file["pd/num_retries"][()].sum()
    assert set(run_file["pd/decode_rank"][()]) == set(range(1, 7))  # every decode die served


def test_pd_with_afd_decode_and_mtp_equals_reference(tmp_path):
    # configs/pd_afd.yaml: 1 prefill die -> 2 DP domains x 1 attention die, 2 expert dies
    result = subprocess.run(
        [str(XDS_MPI), "run", "pd_afd", "--check", "--set", f"run.output_dir={tmp_path}"]
        + ["--set", "scheduler.mtp_depth=1", "--set", "workload.ignore_eos=true"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, explain(result)
    assert check_line(result) == "check: 6 requests, 48 tokens, 0 mismatches"
    assert "pd: 6 KV transfers over XCCL p2p" in result.stdout + result.stderr


# -- refused before launch ------------------------------------------------------------------
def pd_config(*sets: str):
    return load_config(REPO_ROOT / "configs" / "pd.yaml", list(sets))


@pytest.mark.parametrize(
    "sets, words",
    [
        (
            ["deployment.num_prefill_dies=0"],
            ["pd.enabled needs prefill dies", "num_prefill_dies(0)"],
        ),
        (
            ["xccl.p2p_pairs=none"],
            ["decode die rank 2 has no p2p pair with prefill die rank 6", "8 of 8", "(none)"],
        ),
        (
            ["deployment.num_prefill_dies=1", "deployment.max_routed_experts_per_die=8"],
            ["num_routed_experts(16)", "num_prefill_dies(1)", "max_routed_experts_per_die(8)"],
        ),
        (
            ["deployment.shared_experts=dedicated", "deployment.num_shared_expert_dies=1"],
            ["shared_experts(dedicated)"],
        ),
        (
            [
                "deployment.dp_groups_per_domain=1",
                "deployment.num_prefill_dies=4",
                "xccl.slot_bytes=1024",
                "xccl.ring_slots=2",
                "xccl.max_window_bytes=300000",
            ],
            ["prefill die rank 3's window needs 544768 B", "(300000)"],
        ),
        (["deployment.num_host_ranks=3"], ["num_host_ranks(3) must be 1", "or 2"]),
        (["pd.num_prefill_tes=3"], ["pd.num_prefill_tes(3) must be between 1", "dies(2)"]),
        (["pd.num_prefill_tes=0"], ["pd.num_prefill_tes(0) must be between 1", "dies(2)"]),
        (
            ["deployment.num_prefill_dies=3", "pd.num_prefill_tes=2"]
            + ["deployment.max_routed_experts_per_die=8"],
            ["num_prefill_dies(3) / pd.num_prefill_tes(2) = 1 dies", "per_die(8)"],
        ),
    ],
)
def test_pd_configs_that_cannot_run_are_refused_with_numbers(sets, words):
    with pytest.raises(ConfigError) as refused:
        DeploymentPlan.build(pd_config(*sets))
    for word in words:
        assert word in str(refused.value)


def test_validate_prints_the_pd_layout_and_p2p_windows():
    result = subprocess.run(
        [str(XDS_MPI), "validate", "pd", "--brief"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "JE rank 0; decode TE-shell rank 1; prefill DP groups 2 (ranks [6, 7], leader 6)" in (
        result.stdout
    )
    assert "8 prefill->decode pairs" in result.stdout and "rank 2: 262400" in result.stdout


# -- the prefill leader's decision (no MPI) ---------------------------------------------------
def request(req_id: int, prompt_len: int) -> Request:
    return Request(req_id=req_id, prompt=(1,) * prompt_len, max_new_tokens=4)


def status(free=8, room=4, queued=0, cls=-1) -> PrefillStatus:
    return PrefillStatus(free_blocks=free, room=room, queued_tokens=queued, length_class=cls)


def test_leader_balances_tokens_and_never_mixes_long_and_short():
    pending = [request(0, 60), request(1, 10), request(2, 12), request(3, 50)]
    batches, left = assign(
        pending,
        [status(), status(queued=5)],
        block_tokens=16,
        long_prompt_tokens=48,
        step_tokens=1000,
    )
    ids = [[r.req_id for r in batch] for batch in batches]
    assert ids == [[0, 3], [1, 2]] and left == []  # long on group 0, short on group 1


def test_leader_keeps_what_no_group_can_hold():
    # request 0 needs 3 blocks, no group has them; request 1 (1 block) still goes ahead
    pending = [request(0, 40), request(1, 8)]
    batches, left = assign(
        pending,
        [status(free=2, room=1), status(free=0)],
        block_tokens=16,
        long_prompt_tokens=0,
        step_tokens=1000,
    )
    assert [[r.req_id for r in b] for b in batches] == [[1], []]
    assert [r.req_id for r in left] == [0]


def test_leader_leaves_more_than_a_step_shared():
    # one step holds 64 rows: each group takes prompts up to that, the rest waits in the pool
    pending = [request(i, 30) for i in range(6)]
    batches, left = assign(
        pending, [status(), status()], block_tokens=16, long_prompt_tokens=0, step_tokens=64
    )
    assert [[r.req_id for r in b] for b in batches] == [[0, 2], [1, 3]]
    assert [r.req_id for r in left] == [4, 5]
