"""Faults in combination (xDeepServe §6.2: the recovery stages compose): a lost decode die beside
transient XCCL faults, a memory fault during a failover, an EPLB swap in flight when a die is
lost. Each run is served with `--check` against the single-process reference; what stays
refused is refused before launch, with the reason asserted.

The fault table is declarative (die, op, layer, iteration); the expected fault count is the
table's, exactly: a fault of the iteration a fence cut is not fired again after the rebuild
(ranks/recovery/recompute.py IterationAttempts.first_execution), and a lost die's faults voted
before its loss stay counted (Recomputer.report)."""

from __future__ import annotations

import pytest
import yaml
from harness import REPO_ROOT
from test_decode_failover import RING, assert_detected, served
from test_serving import check_line

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology


def table(*rows: tuple[int, str, int, int, int]) -> str:
    """faults.table from (die, op, layer, iteration, times) rows."""
    return (
        "faults.table=["
        + ", ".join(
            f"{{die: {d}, op: {op}, layer: {layer}, iteration: {it}, times: {times}}}"
            for d, op, layer, it, times in rows
        )
        + "]"
    )


def assert_served(result, served_line: str, num_faults: int) -> None:
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == served_line, out[-3000:]
    assert f"recovery: {num_faults} faults injected" in result.stdout, out[-3000:]


# -- colocated: stuck / dead + transient ------------------------------------------------------
@pytest.mark.failure_cell("colocated", "stuck + transient")
def test_a_die_stuck_for_good_beside_transient_faults_is_scaled_away_every_fault_counted_once(
    tmp_path,
):
    """Die 3 blocks for good in its dispatch of iteration 3 (a stuck row at iteration 4: the die
    has counted 4 busy iterations there). Its own fault at iteration 1 is voted before the loss;
    die 1's fault at iteration 3 fires in the execution the fence cuts (never voted) and must not
    fire again when the survivors re-run iteration 3; die 4 fails iteration 6 twice on the
    survivors' communicator. 1 + 1 + 2 = 4 faults."""
    rows = table(
        (3, "combine", 2, 1, 1),  # the die later lost
        (1, "dispatch", 1, 3, 1),  # the iteration the fence cuts
        (4, "combine", 3, 6, 2),  # after the rebuild, on the survivors
    )
    stuck = "{kind: stuck, die: 3, iteration: 4}"
    result, run_file, records = served(tmp_path, [stuck], rows, *RING)
    assert_served(result, "check: 8 requests, 128 tokens, 0 mismatches", 4)
    [record] = records  # no false verdict on any other die
    assert_detected(record, 3, "dead")  # silent after the grace: called dead
    assert record.recovery.startswith("vertical scaling: 4 -> 3 decode dies"), record.describe()
    summary = run_file["summary"].attrs
    # 3 voted failures (iterations 1, 6, 6) and the fenced execution of iteration 3.
    assert (summary["rollbacks"], summary["recomputed_iterations"]) == (4, 3)


@pytest.mark.failure_matrix
def test_a_dead_die_beside_a_fault_rate_is_scaled_away_and_the_survivors_keep_recomputing(
    tmp_path,
):
    """faults.rate per call (seed 0) before and after die 2's loss: the seeded draws fail
    iterations 0, 1, 4 (die 2's own fault) before the loss and 8, 12 after, 7 faults in all."""
    dead = "{kind: dead, die: 2, iteration: 5}"
    settings = ["faults.rate=0.02", "faults.max_retries=12", *RING]
    result, run_file, records = served(tmp_path, [dead], *settings)
    assert_served(result, "check: 8 requests, 128 tokens, 0 mismatches", 7)
    [record] = records
    assert_detected(record, 2, "dead")
    assert "die 3 dispatch at layer 1" in result.stdout + result.stderr  # after the loss
    assert run_file["summary"].attrs["rollbacks"] == 7


# -- afd and PD: the same mechanism (Recomputer.regroup after AfdDieBase / ColocatedDie.rebuild) -
@pytest.mark.failure_matrix
def test_a_dead_attention_die_beside_transient_faults_is_dropped(tmp_path):
    rows = table((5, "a2e", 2, 3, 1), (1, "e2a", 1, 7, 1))  # before and after the loss
    dead = "{kind: dead, die: 2, iteration: 5}"
    result, _, records = served(tmp_path, [dead], rows, config="afd")
    assert_served(result, "check: 8 requests, 128 tokens, 0 mismatches", 2)
    [record] = records
    assert_detected(record, 2, "dead")
    assert record.recovery.startswith("vertical scaling: 4 -> 3 attention dies")


@pytest.mark.failure_matrix
def test_a_dead_pd_decode_die_beside_transient_faults_is_scaled_away(tmp_path):
    """Die 2, the decode dies' first (the one that logged their rollbacks), is lost: the
    survivors' first logs the rollback of iteration 6."""
    rows = table((3, "dispatch", 1, 1, 1), (4, "combine", 2, 6, 1), (6, "p2p_send", 0, 1, 1))
    pd = [
        "health.probe_timeout_s=12",
        "workload.num_requests=6",
        "workload.output_len=10",
        "workload.max_output_len=10",
        "workload.ignore_eos=true",
    ]
    dead = "{kind: dead, die: 2, iteration: 3}"
    result, run_file, records = served(tmp_path, [dead], rows, *RING, *pd, config="pd")
    assert_served(result, "check: 6 requests, 60 tokens, 0 mismatches", 2)
    assert run_file["summary"].attrs["pd_send_faults"] == 1  # retried by the sender
    [record] = records
    assert record.recovery.startswith("vertical scaling: 4 -> 3 decode dies"), record.describe()
    assert "iteration 6 rolled back (die 4 combine at layer 2" in result.stdout + result.stderr


def _refusal(sections: dict) -> str:
    cfg = config_from_dict(sections)
    with pytest.raises(ConfigError) as refused:
        check_failures(cfg, Topology.from_config(cfg))
    return str(refused.value)


def test_a_table_row_the_loss_keeps_from_firing_is_refused_before_launch():
    dead = {"kind": "dead", "die": 2, "iteration": 3}
    late = {"die": 2, "op": "dispatch", "layer": 1, "iteration": 3}
    message = _refusal({"faults": {"events": [dead], "table": [late]}})
    assert message.startswith("faults.table[0]: die 2 at iteration 3, but faults.events[0]")
    assert "runs iterations 0..2 only, so the row would never fire" in message
    # The same die before its loss, and another die after it, run.
    early = {**late, "iteration": 2}
    other = {**late, "die": 1, "iteration": 7}
    cfg = config_from_dict({"faults": {"events": [dead], "table": [early, other]}})
    check_failures(cfg, Topology.from_config(cfg))


# -- memory faults during a failover ----------------------------------------------------------
@pytest.mark.failure_matrix
def test_a_kv_memory_fault_during_a_failover_ends_its_victims_and_nothing_else(tmp_path):
    """Die 2 falls silent after iteration 4; die 3 reports KV blocks 0..7 faulty at iteration 5,
    the iteration its peers wait in for die 2 (the memory check runs before the dies agree). The
    victims end (named, not checked), die 2's requests are prefilled again, the rest equal the
    reference."""
    rows = [
        "{kind: dead, die: 2, iteration: 5}",
        "{kind: memory, die: 3, iteration: 5, first_block: 0, num_blocks: 8}",
    ]
    result, run_file, records = served(tmp_path, rows, *RING, "workload.ignore_eos=true")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    dead, memory = sorted(records, key=lambda r: r.kind)
    assert_detected(dead, 2, "dead")
    assert dead.recovery.startswith("vertical scaling: 4 -> 3 decode dies")
    victims = list(memory.requests_lost)
    assert memory.die == 3 and victims and not set(victims) & set(dead.requests_affected)
    status = [s.decode() for s in run_file["requests"]["status"][()]]
    assert [i for i, s in enumerate(status) if s == "lost"] == victims
    checked = 8 - len(victims)
    assert check_line(result) == (
        f"check: {checked} requests, {16 * checked} tokens, 0 mismatches; "
        f"{len(victims)} lost, not checked: {victims}"
    )


def test_a_memory_fault_beside_a_lost_die_stays_refused_where_it_cannot_run():
    """afd (KV blocks or a slot) and colocated expert slots: refused with what is missing."""
    afd = yaml.safe_load((REPO_ROOT / "configs" / "afd.yaml").read_text())
    kv = {"kind": "memory", "die": 1, "iteration": 3, "first_block": 0, "num_blocks": 4}
    dead = {"kind": "dead", "die": 2, "iteration": 5}
    message = _refusal({**afd, "faults": {"events": [kv, dead]}})
    assert "a memory fault (KV blocks of die 1) beside 1 stuck/dead row(s)" in message
    assert "the TE-shell would need to" in message
    slot = {"kind": "memory", "die": 3, "iteration": 3, "slot": 0}
    ring = {"deployment": {"redundant_slots_per_die": 4}, "health": {"replicas": "ring"}}
    message = _refusal({**ring, "faults": {"events": [slot, dead]}})
    assert "masking expert slot 0 of die 3 beside stuck/dead rows (1)" in message
    assert "it would need the mask kept apart and applied to each new placement" in message


# -- an EPLB swap in flight when a die is lost ------------------------------------------------
EPLB_SLOW_SWAPS = [  # a swap loads one slot per die and iteration: swaps span iterations
    "deployment.redundant_slots_per_die=5",
    "health.replicas=ring",
    "eplb.enabled=true",
    "eplb.interval=2",
    "eplb.slices=1",
    "eplb.load_slots_per_iteration=1",
    "workload.output_len=20",
    "workload.prompt_len=12",
    "workload.ignore_eos=true",
]


@pytest.mark.failure_matrix
def test_an_eplb_swap_in_flight_when_a_die_is_lost_is_dropped_and_transient_faults_recomputed(
    tmp_path,
):
    """On the virtual clock EPLB decides at the same iterations in every run: version 2,
    decided after slice 2 (iterations 4-5), is still loading when die 2 falls silent after
    iteration 6; the survivors install the scaled placement (version 3) instead, and version 2
    never serves. Transient faults before and after the loss are recomputed."""
    rows = table((1, "dispatch", 1, 6, 1), (3, "combine", 2, 9, 1))
    dead = "{kind: dead, die: 2, iteration: 7}"
    result, run_file, records = served(tmp_path, [dead], rows, *EPLB_SLOW_SWAPS)
    assert_served(result, "check: 8 requests, 160 tokens, 0 mismatches", 2)
    [record] = records
    assert_detected(record, 2, "dead")
    eplb = run_file["eplb"]
    [scaled] = eplb["scaling_version"][()]
    served_versions = set(eplb["slice_version_start"][()]) | set(eplb["slice_version_end"][()])
    decided = [v for v in eplb["reconfig_version"][()] if v < scaled]
    in_flight = [v for v in decided if v not in served_versions]
    assert in_flight == [scaled - 1], (list(decided), sorted(served_versions), scaled)
    assert eplb.attrs["num_reconfigs"] > scaled  # EPLB went on over the survivors
