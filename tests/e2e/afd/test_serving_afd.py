"""Disaggregated MoE-attention end to end: `xds-mpi run afd --check` equals the reference.

Each run combines several properties to keep the file short on 2 cores: DP domains taking turns,
M microbatches, idle domains (fewer requests than attention dies), uneven load (prompt lengths
and requests per die differ, some dies of a busy domain have none), more expert dies than
attention dies per domain and not a multiple, INT8 routed rows, dedicated shared-expert dies.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import pytest
from harness import REPO_ROOT
from test_serving import XDS_MPI, check_line, reference_acceptance

# (D, G, expert dies) -> (requests, extra settings)
CASES = {
    (1, 2, 2): (5, []),  # 3 + 2 requests
    (2, 2, 3): (
        3,
        [
            "deployment.shared_experts=dedicated",  # domain 1: one die busy
            "deployment.num_shared_expert_dies=1",
        ],
    ),
    (3, 2, 5): (4, []),  # domain 2 idle
    (2, 3, 4): (4, ["xccl.use_int8=false"]),  # 3 + 1 of 6 dies busy
}


def serve(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, h5py.File | None]:
    result = subprocess.run(
        [
            str(XDS_MPI),
            "run",
            "afd",
            "--check",
            "--set",
            f"run.output_dir={tmp_path}",
            "--set",
            "run.name=serve",
            "--set",
            "run.timeout_s=240",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    path = tmp_path / "serve.h5"
    return result, (h5py.File(path, "r") if path.exists() else None)


# The default suite serves three shapes (one microbatch; a dedicated shared-expert die, and INT8
# off, pipelined); the other five (shape, microbatches) pairs, the idle domain among them, run
# with --long.
DEFAULT_CASES = {((1, 2, 2), 1), ((2, 2, 3), 2), ((2, 3, 4), 2)}


@pytest.mark.parametrize(
    "shape,num_microbatches",
    [
        pytest.param(
            shape,
            m,
            id="D{}G{}E{}-{}".format(*shape, m),
            marks=() if (shape, m) in DEFAULT_CASES else pytest.mark.long,
        )
        for shape in CASES
        for m in (1, 2)
    ],
)
def test_every_token_equals_the_reference(tmp_path, shape, num_microbatches):
    domains, groups, experts = shape
    num_requests, extra = CASES[shape]
    settings = [
        f"deployment.num_dp_domains={domains}",
        f"deployment.dp_groups_per_domain={groups}",
        f"deployment.num_expert_dies={experts}",
        f"deployment.num_microbatches={num_microbatches}",
        "model.num_layers=3",
        "model.weights=random",
        f"workload.num_requests={num_requests}",
        "workload.output_len=4",
        "workload.prompt_len=6",
        "workload.length_dist=uniform",
        "workload.max_prompt_len=14",
        "workload.max_output_len=4",
        "workload.ignore_eos=true",
        "scheduler.prefill_chunk_tokens=8",
        *extra,
    ]
    args = [a for s in settings for a in ("--set", s)]
    result, run_file = serve(tmp_path, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    num_tokens = 4 * num_requests
    assert (
        check_line(result) == f"check: {num_requests} requests, {num_tokens} tokens, 0 mismatches"
    )
    attention = list(range(1, 1 + domains * groups))
    assert sorted(map(int, run_file["dies"])) == attention  # every DP group reported
    summary = run_file["summary"].attrs  # A2E / E2A priced, the expert dies' time carried back
    assert summary["projected_ms_A2E (overlapped)"] > 0 and summary["projected_ms_E2A"] > 0
    served_by = list(run_file["requests/die_rank"][()])
    busy_domains = {(rank - 1) // groups for rank in served_by}
    if num_requests < domains * groups:
        assert len(set(served_by)) == num_requests  # some dies had nothing
    if shape == (3, 2, 5):
        assert busy_domains == {0, 1}  # domain 2 sat out


@pytest.mark.parametrize("depth", [pytest.param(1, marks=pytest.mark.long), 2])
def test_mtp_through_a2e_e2a_serves_the_greedy_tokens(tmp_path, depth):
    # 2 domains x 2 groups, 3 expert dies, 2 microbatches: each MTP block is one more MoE layer
    # of A2E/E2A calls; the trained checkpoint, so drafts are accepted.
    settings = [
        "deployment.num_dp_domains=2",
        "deployment.dp_groups_per_domain=2",
        "deployment.num_expert_dies=3",
        "deployment.num_microbatches=2",
        f"scheduler.mtp_depth={depth}",
        "scheduler.prefill_chunk_tokens=8",
        "workload.num_requests=6",
        "workload.output_len=8",
        "workload.prompt_len=12",
    ]
    result, run_file = serve(tmp_path, *[a for s in settings for a in ("--set", s)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 6 requests, 48 tokens, 0 mismatches"
    summary = run_file["summary"].attrs
    assert summary["mtp_accepted"] > 0 and summary["tokens_per_step"] > 1
    drafted, accepted = reference_acceptance(settings, depth, "afd")  # the same drafts
    assert (summary["mtp_drafted"], summary["mtp_accepted"]) == (drafted, accepted)
