"""KV memory faults (xDeepServe §6.2 stage 3): the die masks the faulty blocks, the requests
whose KV was there end with a reason and are named, every other request checks equal, and
`--check` skips the victims by name but still fails on a real mismatch."""

from __future__ import annotations

import subprocess

import h5py
import pytest
from harness import REPO_ROOT
from test_serving import XDS_MPI

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology
from xds_mpi.results.failures import read_failures
from xds_mpi.results.results import RequestRecord, check_against_reference
from xds_mpi.workload.requests import Request


def test_masked_blocks_are_never_handed_out_again():
    table = BlockTable(num_blocks=6, block_tokens=2)
    table.allocate("a", 4)  # blocks 0, 1
    table.allocate("b", 2)  # block 2
    assert table.mask([1, 3]) == ["a"] and table.num_blocks == 4
    table.free("a")  # gives back block 0 only
    table.allocate("c", 6)  # three blocks out of 0, 4, 5
    assert sorted(table.blocks("c")) == [0, 4, 5] and table.num_free_blocks == 0


def test_the_check_skips_victims_by_name_and_still_fails_on_the_rest():
    cfg = config_from_dict({"workload": {"ignore_eos": True}})
    records = {
        i: RequestRecord(req=Request(req_id=i, prompt=(5 + i, 7, 9), max_new_tokens=3))
        for i in range(3)
    }
    records[1].lost = "kv memory fault on die 2 blocks 0..7"
    num_requests, _, mismatches = check_against_reference(cfg, records)
    # Nothing was served: the two checked requests mismatch, the victim is not checked.
    assert num_requests == 2 and len(mismatches) == 2
    assert not any(m.startswith("request 1") for m in mismatches), mismatches


@pytest.mark.parametrize(
    "deployment",
    [
        pytest.param("colocated", marks=pytest.mark.failure_cell("colocated", "memory")),
        pytest.param("pd", marks=pytest.mark.failure_cell("pd", "memory")),
    ],
)
def test_a_kv_memory_fault_ends_its_victims_and_nothing_else(tmp_path, deployment):
    # colocated die 2 (a PD decode die in pd) loses KV blocks 0..7 at its 3rd iteration: the
    # requests holding them end (in PD, a receive in flight just takes other blocks).
    assert_victims_end(tmp_path, deployment)


# EPLB (8 dies, MTP depth 1) shortened to 8 requests of 24 tokens.
EPLB_SHORT = ["workload.num_requests=8", "workload.output_len=24", "workload.max_output_len=24"]


def test_a_kv_memory_fault_with_eplb_ends_its_victims_only(tmp_path):
    """Beside EPLB's swaps (and its MTP drafts, depth 1): victims end, every other request
    equals the reference."""
    assert_victims_end(tmp_path, "eplb", *EPLB_SHORT)


@pytest.mark.failure_matrix  # the fault alone runs by default (the lean matrix's case above)
@pytest.mark.parametrize(
    "settings",
    [["faults.on_timeout=recompute", "xccl.poll_timeout_s=1"], ["scheduler.mtp_depth=1"]],
    ids=["recompute", "mtp"],
)
def test_a_kv_memory_fault_with_recompute_or_mtp_ends_its_victims_only(tmp_path, settings):
    """Beside timeouts recomputed, and with MTP drafts (whose KV lies in the same blocks)."""
    assert_victims_end(tmp_path, "colocated", *settings)


def assert_victims_end(tmp_path, config: str, *settings: str) -> None:
    row = "faults.events=[{kind: memory, die: 2, iteration: 3, first_block: 0, num_blocks: 8}]"
    sets = [f"run.output_dir={tmp_path}", "run.name=mem", "workload.ignore_eos=true", row]
    result = subprocess.run(
        [
            str(XDS_MPI),
            "run",
            config,
            "--check",
            *[a for s in [*sets, *settings] for a in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_file = h5py.File(tmp_path / "mem.h5", "r")
    (record,) = read_failures(run_file)
    victims = list(record.requests_lost)
    assert victims and record.detected_by == "memory check" and record.die == 2
    requests = run_file["requests"]
    status = [s.decode() for s in requests["status"][()]]
    reasons = [s.decode() for s in requests["reason"][()]]
    assert [i for i, s in enumerate(status) if s == "lost"] == victims
    assert {reasons[i] for i in victims} == {"kv memory fault on die 2 blocks 0..7"}
    checked = len(status) - len(victims)
    assert f"check: {checked} requests" in result.stdout
    assert f"0 mismatches; {len(victims)} lost, not checked: {victims}" in result.stdout


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"slot": 0}, "slot 0 of die 2 holds the only copy of routed expert"),
        ({"first_block": 0, "num_blocks": 252}, r"keeps 256 - 252 masked = 4 KV blocks"),
    ],
)
def test_memory_faults_the_dies_cannot_survive_are_refused(row, reason):
    cfg = config_from_dict(
        {"faults": {"events": [{"kind": "memory", "die": 2, "iteration": 0, **row}]}}
    )
    with pytest.raises(ConfigError, match=reason):
        check_failures(cfg, Topology.from_config(cfg))
