"""docs/failure_matrix.md's matrix stays true: deployments x fault kinds x recovery settings, each
cell tested (a test that exists, with the option it runs under), refused (a config the validator
refuses, with words its message carries) or not tried. The cells live here (CELLS), the doc's
table is made from them; a test renamed or removed, a refusal lifted or reworded, a lean-matrix
case (`failure_cell`) missing from the cells, or the doc edited by hand fails here.

`python tests/repo/test_failure_matrix.py` prints the table to paste into docs/failure_matrix.md
(between its `matrix:begin` and `matrix:end` markers)."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "failure_matrix.md"
FAILOVER = REPO / "tests" / "e2e" / "failover"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


@dataclass(frozen=True)
class CellTested:
    """test: "<module>::<function>", the module under tests/e2e/failover/ or elsewhere in tests/."""

    test: str


@dataclass(frozen=True)
class CellRefused:
    """config: a file of configs/; sets: `--set` overrides; words: in the validator's message."""

    config: str
    sets: tuple[str, ...]
    words: str


NOT_TRIED = None

# Heartbeats generous enough to detect a loss before the peers' XCCL waits time out.
HEALTH = ("health.timeout_s=4", "health.dp_interval_s=0.2")
RING = ("deployment.redundant_slots_per_die=4", "health.replicas=ring", *HEALTH)
DEAD2 = "faults.events=[{kind: dead, die: 2, iteration: 5}]"
LINK = "faults.events=[{kind: link, die: 2, peer: 3, iteration: 1}]"
MEM_SLOT = "{kind: memory, die: 3, iteration: 3, slot: 0}"
EPLB = ("deployment.redundant_slots_per_die=5", "health.replicas=ring", "eplb.enabled=true")
TWO = ("deployment.num_microbatches=2",)
EMS = ("ems.enabled=true",)
TABLE = "faults.table=[{die: 1, op: dispatch, layer: 1, iteration: 2}]"
STREAMS = "(the two-stream decode) does not support {} yet"
LINK_DIES = "a link fault hits a prefill die"  # the prefill side of a KV transfer: PD only
EMS_ROWS = "faults.events row(s): a pool rank waits for every die's end of run"

# (deployment, recovery setting, fault kind) -> status. Recovery "-": the setting does not
# matter to the kind. Kinds joined by "+" are faults in one run.
CELLS: dict[tuple[str, str, str], CellTested | CellRefused | None] = {
    # -- colocated ------------------------------------------------------------------------------
    ("colocated", "-", "transient"): CellTested(
        "test_recompute.py::test_colocated_faults_at_first_middle_last_and_mtp_layers"
    ),
    ("colocated", "-", "rate"): CellTested(
        "test_recompute.py::test_a_hundred_seeded_random_faults"
    ),
    ("colocated", "-", "stuck, back before timeout_s"): CellTested(
        "test_decode_failover.py::test_a_stuck_die_back_before_the_timeout_is_a_transient"
    ),
    ("colocated", "ring", "stuck, lost or back late"): CellTested(
        "test_decode_failover.py::test_failure_matrix"
    ),
    ("colocated", "ring", "dead"): CellTested(
        "test_decode_failover.py::test_a_dead_die_mid_run_is_scaled_away_and_its_requests_served"
        "_elsewhere"
    ),
    ("colocated", "none, on_expert_lost stop", "dead"): CellTested(
        "test_decode_failover.py::test_a_dead_die_holding_the_last_replica_stops_the_run_naming"
        "_die_and_experts"
    ),
    ("colocated", "on_expert_lost restart", "dead"): CellRefused(
        "colocated.yaml",
        (*HEALTH, "health.on_expert_lost=restart", DEAD2),
        "health.on_expert_lost=restart (stage 1: rebuild the decode side on the remaining dies)",
    ),
    ("colocated", "ring, MTP", "dead"): CellRefused(
        "colocated.yaml",
        (*RING, "scheduler.mtp_depth=1", DEAD2),
        "their MTP drafts restart from that prefill",
    ),
    ("colocated", "MTP", "stuck, back before timeout_s"): CellTested(
        "test_decode_failover.py::test_a_stuck_die_back_before_the_timeout_with_mtp_is_a_transient"
    ),
    ("colocated", "ring, on_timeout recompute", "stuck, back late"): CellTested(
        "test_timeout_recovery.py::test_a_lost_peer_is_left_to_the_heartbeats"
    ),
    ("colocated", "-", "link"): CellRefused("colocated.yaml", (LINK,), LINK_DIES),
    ("colocated", "-", "memory"): CellTested(
        "test_memory_faults.py::test_a_kv_memory_fault_ends_its_victims_and_nothing_else"
    ),
    ("colocated", "on_timeout recompute, or MTP", "memory"): CellTested(
        "test_memory_faults.py::test_a_kv_memory_fault_with_recompute_or_mtp_ends_its_victims_only"
    ),
    ("colocated", "ring", "memory (slot)"): CellTested(
        "test_slot_faults.py::test_a_routed_and_a_redundant_slot_are_masked_and_the_tokens_equal"
        "_the_reference"
    ),
    ("colocated", "ring", "stuck + transient"): CellTested(
        "test_fault_combinations.py::test_a_die_stuck_for_good_beside_transient_faults_is_scaled"
        "_away_every_fault_counted_once"
    ),
    ("colocated", "ring", "dead + rate"): CellTested(
        "test_fault_combinations.py::test_a_dead_die_beside_a_fault_rate_is_scaled_away_and_the"
        "_survivors_keep_recomputing"
    ),
    ("colocated", "ring", "dead + memory"): CellTested(
        "test_fault_combinations.py::test_a_kv_memory_fault_during_a_failover_ends_its_victims"
        "_and_nothing_else"
    ),
    ("colocated", "ring", "dead + memory (slot)"): CellRefused(
        "colocated.yaml",
        (*RING, f"faults.events=[{MEM_SLOT}, {{kind: dead, die: 2, iteration: 5}}]"),
        "it would need the mask kept apart and applied to each new placement",
    ),
    # -- afd (disaggregated MoE-attention) ------------------------------------------------------
    ("afd", "-", "transient"): CellTested(
        "test_recompute.py::test_afd_faults_on_attention_trampoline_and_expert_dies"
    ),
    ("afd", "-", "rate"): CellTested(
        "test_recompute.py::test_afd_and_pd_serve_a_fault_rate_in_users_units_exactly"
    ),
    ("afd", "attention die", "stuck, back before timeout_s"): CellTested(
        "test_afd_failover.py::test_an_a2e_wait_timed_out_on_a_slow_attention_die_is_recomputed"
    ),
    ("afd", "attention die", "dead"): CellTested(
        "test_afd_failover.py::test_a_dead_attention_die_mid_run_is_dropped_and_its_requests"
        "_served_elsewhere"
    ),
    ("afd", "expert die, ring", "stuck, lost"): CellTested(
        "test_afd_failover.py::test_lost_dies_early_stuck_for_good_or_trampolines"
    ),
    ("afd", "expert die, ring", "dead"): CellTested(
        "test_afd_failover.py::test_a_dead_expert_die_mid_run_is_dropped_when_every_expert_keeps"
        "_a_replica"
    ),
    ("afd", "expert die, none, on_expert_lost stop", "dead"): CellTested(
        "test_afd_failover.py::test_an_expert_die_dead_early_without_a_replica_stops_naming_die"
        "_and_experts"
    ),
    ("afd", "attention or expert die, stop or recompute", "stuck, back late"): CellTested(
        "test_afd_failover.py::test_a_die_back_late_or_lost_with_or_without_recompute_is_scaled"
        "_away"
    ),
    ("afd", "expert die, ring, on_timeout recompute", "dead or stuck, lost"): CellTested(
        "test_afd_failover.py::test_a_die_back_late_or_lost_with_or_without_recompute_is_scaled"
        "_away"
    ),
    ("afd", "expert die, stop or recompute", "stuck, back before timeout_s"): CellTested(
        "test_afd_failover.py::test_an_expert_die_back_before_the_timeout_is_a_transient"
    ),
    ("afd", "-", "link"): CellRefused("afd.yaml", (LINK,), LINK_DIES),
    ("afd", "-", "memory"): CellTested(
        "test_afd_memory_faults.py::test_a_kv_memory_fault_on_an_attention_die_ends_its_request"
        "_and_nothing_else"
    ),
    ("afd", "on_timeout recompute, or MTP", "memory"): CellTested(
        "test_afd_memory_faults.py::test_a_kv_memory_fault_with_recompute_or_mtp_ends_its_request"
        "_only"
    ),
    ("afd", "-", "pool"): CellRefused(
        "afd.yaml", EMS, "ems.enabled needs pd.enabled or deployment.kind colocated"
    ),
    ("afd", "attention die", "dead + transient"): CellTested(
        "test_fault_combinations.py::test_a_dead_attention_die_beside_transient_faults_is_dropped"
    ),
    ("afd", "attention die", "dead + memory"): CellRefused(
        "afd.yaml",
        (
            *HEALTH,
            "faults.events=[{kind: memory, die: 1, iteration: 3, first_block: 0, num_blocks: 4},"
            " {kind: dead, die: 2, iteration: 5}]",
        ),
        "would need to end a memory fault's victims before it re-prefills",
    ),
    ("afd", "attention die", "dead + dead"): CellRefused(
        "afd.yaml",
        (
            *HEALTH,
            "faults.events=[{kind: dead, die: 1, iteration: 5},"
            " {kind: dead, die: 3, iteration: 7}]",
        ),
        "2 stuck/dead rows in one afd run",
    ),
    # -- PD (disaggregated prefill-decode) ------------------------------------------------------
    ("PD", "-", "transient"): CellTested(
        "test_recompute.py::test_pd_kv_transfer_and_decode_faults_are_retried_and_recomputed"
    ),
    ("PD", "-", "transient (decode dies), virtual clock"): CellTested(
        "test_rollback_priced.py::test_pd_decode_faults_run_on_the_virtual_clock_and_cost_their"
        "_attempts"
    ),
    ("PD", "-", "rate"): CellTested(
        "test_recompute.py::test_afd_and_pd_serve_a_fault_rate_in_users_units_exactly"
    ),
    ("PD", "prefill die", "stuck, lost"): CellTested(
        "test_prefill_loss.py::test_a_lost_prefill_die_loses_no_request"
    ),
    ("PD", "prefill die", "dead"): CellTested(
        "test_prefill_loss.py::test_a_lost_prefill_die_loses_no_request"
    ),
    ("PD", "decode die, ring", "stuck, lost"): CellTested(
        "test_pd_decode_loss.py::test_a_decode_die_stuck_for_good_is_lost_and_the_survivors_late"
        "_echoes_are_no_verdict"
    ),
    ("PD", "decode die, ring", "dead"): CellTested(
        "test_pd_decode_loss.py::test_a_dead_decode_die_mid_run_is_scaled_away_its_requests"
        "_prefilled_again"
    ),
    ("PD", "decode die, none", "dead"): CellRefused(
        "pd.yaml",
        (*HEALTH, "health.probe_timeout_s=12", DEAD2),
        "a PD run's stop on an expert's last replica would need the JE",
    ),
    ("PD", "-", "link"): CellTested(
        "test_link_probe.py::test_a_link_fault_is_called_link_and_its_requests_rerouted"
    ),
    ("PD", "-", "memory"): CellTested(
        "test_memory_faults.py::test_a_kv_memory_fault_ends_its_victims_and_nothing_else"
    ),
    ("PD", "decode die, ring", "dead + transient"): CellTested(
        "test_fault_combinations.py::test_a_dead_pd_decode_die_beside_transient_faults_is_scaled"
        "_away"
    ),
    ("PD", "decode die, ring", "dead + memory"): CellRefused(
        "pd.yaml",
        (
            *RING,
            "health.probe_timeout_s=12",
            "faults.events=[{kind: dead, die: 2, iteration: 5},"
            " {kind: memory, die: 3, iteration: 3, first_block: 0, num_blocks: 4}]",
        ),
        "with other fault rows",
    ),
    # -- PD with an afd decode side -------------------------------------------------------------
    ("PD+afd", "-", "transient"): CellTested(
        "test_rollback_priced.py::test_pd_afd_decode_faults_run_on_the_virtual_clock_and_cost"
        "_their_attempts"
    ),
    ("PD+afd", "attention die", "dead"): CellTested(
        "test_pd_decode_loss.py::test_a_dead_attention_die_of_a_pd_afd_decode_side_is_dropped_its"
        "_requests_prefilled_again"
    ),
    ("PD+afd", "-", "memory"): CellTested(
        "test_afd_failover.py::test_a_kv_memory_fault_on_a_pd_afd_attention_die_ends_its_victims"
        "_and_nothing_else"
    ),
    # -- with EMS (the pool of cached prefixes) -------------------------------------------------
    ("EMS (PD)", "-", "pool"): CellTested(
        "test_ems.py::test_a_dead_pool_rank_falls_back_to_recompute"
    ),
    ("EMS (PD)", "-", "pool rank stuck"): CellRefused(
        "pd.yaml", (*EMS, "faults.events=[{kind: stuck, die: 8, iteration: 2}]"), EMS_ROWS
    ),
    ("EMS (colocated)", "-", "pool"): CellTested(
        "test_ems_colocated.py::test_a_block_evicted_mid_lookup_on_a_colocated_die_falls_back"
    ),
    ("EMS (colocated)", "-", "transient"): CellTested(
        "test_ems_colocated.py::test_transient_faults_beside_the_pool_leave_its_hits_and_puts_as"
        "_without_faults"
    ),
    ("EMS (colocated)", "ring", "dead"): CellRefused(
        "colocated.yaml", (*EMS, *RING, DEAD2), EMS_ROWS
    ),
    ("EMS (colocated)", "-", "memory"): CellRefused(
        "colocated.yaml",
        (
            *EMS,
            "faults.events=[{kind: memory, die: 2, iteration: 3, first_block: 0, num_blocks: 4}]",
        ),
        EMS_ROWS,
    ),
    # -- with EPLB ------------------------------------------------------------------------------
    ("EPLB", "-", "rate"): CellTested(
        "test_recompute.py::test_a_rate_in_users_units_is_converted_and_served_exactly"
    ),
    ("EPLB", "ring", "stuck, back within the grace"): CellTested(
        "test_eplb_failover.py::test_a_stuck_die_back_within_the_grace_keeps_eplb_on_all_dies"
    ),
    ("EPLB", "ring", "dead"): CellTested(
        "test_eplb_failover.py::test_a_dead_die_with_eplb_is_scaled_away_and_eplb_rebalances_the"
        "_survivors"
    ),
    ("EPLB", "none, on_expert_lost stop", "dead"): CellTested(
        "test_eplb_failover.py::test_a_dead_die_with_eplb_and_no_replica_left_stops_the_run_naming"
        "_die_and_experts"
    ),
    ("EPLB", "ring", "dead + transient, a swap in flight"): CellTested(
        "test_fault_combinations.py::test_an_eplb_swap_in_flight_when_a_die_is_lost_is_dropped_and"
        "_transient_faults_recomputed"
    ),
    ("EPLB", "-", "memory"): CellTested(
        "test_memory_faults.py::test_a_kv_memory_fault_with_eplb_ends_its_victims_only"
    ),
    ("EPLB", "ring", "memory (slot)"): CellRefused(
        "colocated.yaml",
        (*EPLB, f"faults.events=[{MEM_SLOT}]"),
        "or with eplb.enabled(True) is refused",
    ),
    # -- two streams (colocated, deployment.num_microbatches 2) ---------------------------------
    ("two streams", "-", "transient"): CellRefused(
        "colocated.yaml", (*TWO, TABLE), STREAMS.format("faults.table")
    ),
    ("two streams", "-", "rate"): CellRefused(
        "colocated.yaml", (*TWO, "faults.rate=0.001"), STREAMS.format("faults.rate")
    ),
    ("two streams", "-", "dead"): CellRefused(
        "colocated.yaml", (*TWO, *HEALTH, DEAD2), STREAMS.format("faults.events")
    ),
    ("two streams", "ring", "dead"): CellRefused(
        "colocated.yaml", (*TWO, *RING), STREAMS.format("health.replicas")
    ),
    ("two streams", "-", "memory"): CellRefused(
        "colocated.yaml",
        (
            *TWO,
            "faults.events=[{kind: memory, die: 2, iteration: 3, first_block: 0, num_blocks: 4}]",
        ),
        STREAMS.format("faults.events"),
    ),
}


def _test_path(test: str) -> tuple[Path, str]:
    file, name = test.split("::")
    found = [FAILOVER / file] if (FAILOVER / file).exists() else list(REPO.glob(f"tests/**/{file}"))
    assert len(found) == 1, f"{test}: {len(found)} files named {file} under tests/"
    return found[0], name


def _source(test: str) -> str:
    """`test`'s function with its decorators, as source (its markers and options are there)."""
    path, name = _test_path(test)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.unparse(node)
    raise AssertionError(f"{test}: no function {name} in {path.relative_to(REPO)}")


def _status(cell: CellTested | CellRefused | None) -> str:
    if cell is None:
        return "not tried"
    if isinstance(cell, CellRefused):
        return f"refused: {cell.words}"
    source = _source(cell.test)
    option = " [--long]" if "mark.long" in source else ""
    if "mark.failure_matrix" in source or "'--failure-matrix'" in source:
        option += " [--failure-matrix]"
    lean = " (lean matrix)" if "failure_cell" in source else ""
    return f"tested{option}{lean}: `{cell.test}`"


def table() -> str:
    rows = ["| deployment | recovery | fault | status |", "|---|---|---|---|"]
    for (deployment, recovery, kind), cell in CELLS.items():
        rows.append(f"| {deployment} | {recovery} | {kind} | {_status(cell)} |")
    return "\n".join(rows)


def _doc_table() -> str:
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC.name}: no {BEGIN} ... {END} markers"
    return text.split(BEGIN)[1].split(END)[0].strip()


def test_the_doc_s_matrix_is_the_cells():
    assert _doc_table() == table(), "run `python tests/repo/test_failure_matrix.py` and paste"


def test_every_tested_cell_names_a_test_that_exists():
    for cell in CELLS.values():
        if isinstance(cell, CellTested):
            _source(cell.test)  # raises naming the test when missing


@pytest.mark.parametrize(
    "key", [k for k, c in CELLS.items() if isinstance(c, CellRefused)], ids=" / ".join
)
def test_every_refused_cell_is_refused_with_its_words(key):
    cell = CELLS[key]
    cfg = load_config(REPO / "configs" / cell.config, list(cell.sets))
    with pytest.raises(ConfigError) as refused:
        DeploymentPlan.build(cfg)
    assert cell.words in str(refused.value), str(refused.value)


def test_every_lean_matrix_case_is_a_cell():
    """A test marked failure_cell (the default suite's lean matrix) is listed in CELLS."""
    listed = {c.test for c in CELLS.values() if isinstance(c, CellTested)}
    for path in sorted(FAILOVER.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "failure_cell" in ast.unparse(node):
                assert f"{path.name}::{node.name}" in listed, f"{path.name}::{node.name}"


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
