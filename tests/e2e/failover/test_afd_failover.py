"""Stuck and dead dies of disaggregated MoE-attention (xDeepServe §6.1-6.2, configs/afd.yaml:
TE-shell rank 0, attention dies 1-4 in DP domains {1, 2} and {3, 4}, expert dies 5-7, 5 and 6
the trampolines). The TE-shell's heartbeats find a silent attention or expert die, its fence
releases the dies waiting in A2E/E2A or the agreement, and the run never hangs: a lost attention
die is dropped from a rebuilt A2E/E2A and its requests are re-prefilled on the other attention
dies, every token equal to the reference; a lost expert die is dropped when every expert keeps a
replica (health.replicas ring), else the run stops naming die and experts."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml
from harness import REPO_ROOT
from test_decode_failover import CEILING_S, EARLY, assert_detected, served
from test_serving import check_line

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology

# One request per attention die keeps each run short; dying at iteration 5 of 16 is mid-run.
LEAN = ["run.trace=false", "workload.num_requests=4"]
SERVED = "check: 4 requests, 64 tokens, 0 mismatches"
# Each expert die's 6 redundant slots hold the next expert die's routed experts (5 or 6).
RING = ["deployment.redundant_slots_per_die=6", "health.replicas=ring"]


def afd_served(tmp_path, rows: list[str], *settings: str):
    return served(tmp_path, rows, *LEAN, *settings, config="afd")


@pytest.mark.failure_cell("afd", "dead")
def test_a_dead_attention_die_mid_run_is_dropped_and_its_requests_served_elsewhere(tmp_path):
    result, _, records = afd_served(tmp_path, ["{kind: dead, die: 2, iteration: 5}"])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED  # every token equal to the reference
    [record] = records  # no false verdict on any other die (expert dies included)
    assert (record.kind, record.role, record.injected_iteration) == ("dead", "attention", 5)
    assert_detected(record, 2, "dead")
    assert record.recovery.startswith("vertical scaling: 4 -> 3 attention dies"), record.describe()
    assert record.requests_affected  # die 2 held requests when it died
    assert record.tokens_per_s_before > 0 and record.tokens_per_s_after > 0


def test_a_dead_expert_die_mid_run_is_dropped_when_every_expert_keeps_a_replica(tmp_path):
    result, _, records = afd_served(tmp_path, ["{kind: dead, die: 7, iteration: 5}"], *RING)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert check_line(result) == SERVED
    [record] = records
    assert (record.kind, record.role, record.injected_iteration) == ("dead", "expert", 5)
    assert_detected(record, 7, "dead")
    assert record.recovery.startswith("vertical scaling: 3 -> 2 expert dies"), record.describe()
    assert record.tokens_per_s_after > 0


@pytest.mark.failure_matrix
def test_an_expert_die_dead_early_without_a_replica_stops_naming_die_and_experts(tmp_path):
    result, run_file, records = afd_served(tmp_path, ["{kind: dead, die: 7, iteration: 1}"])
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert run_file.attrs["status"].startswith("failed: die rank 7 (dead) silent")
    [record] = records
    assert (record.kind, record.role, record.injected_iteration) == ("dead", "expert", 1)
    assert_detected(record, 7, "dead")
    assert record.recovery.startswith("none, the run stops: an expert lost its last replica")
    # Expert die rank 7 (die index 6) holds routed experts 11-15 alone, in each of the 3 MoE
    # layers of the tiny model (mtp_depth 0).
    lost = "; ".join(f"layer {layer}: experts [11, 12, 13, 14, 15]" for layer in range(3))
    stop = "health.on_expert_lost=stop: die rank 7: removing die 6 leaves no replica of: "
    assert stop + lost in out


@pytest.mark.failure_matrix
def test_a_stuck_attention_die_back_before_the_timeout_is_a_transient(tmp_path):
    rows = ["{kind: stuck, die: 3, iteration: 4, duration_s: 1.5}"]
    result, run_file, records = afd_served(tmp_path, rows)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == SERVED
    [record] = records
    assert (record.kind, record.die, record.verdict) == ("stuck", 3, "transient")
    assert record.detection_s == -1 and record.injected_iteration >= 4
    assert "silent for more than" not in result.stdout + result.stderr
    # The stall is priced on the virtual clock (before, an afd die's cost nothing there): the
    # iteration it struck lasts 1.5 s more on every attention die (its peers follow its records).
    assert run_file["summary"].attrs["serving_clock"] == "virtual"
    for die in run_file["dies"].values():
        assert float(np.max(die["vtime_s"][()])) > 1.5


@pytest.mark.parametrize(
    "row, die, settings, recovery",
    [
        # Stuck for good inside its A2E: never answers again, lost as dead
        # (ranks/recovery/detector.py).
        ("{kind: stuck, die: 4, iteration: 3}", 4, [], "vertical scaling: 4 -> 3 attention"),
        ("{kind: dead, die: 1, iteration: 0}", 1, EARLY, "vertical scaling: 4 -> 3 attention"),
        # Trampolines: their attention groups move to the expert dies left (experts[g]).
        ("{kind: stuck, die: 6, iteration: 3}", 6, RING, "vertical scaling: 3 -> 2 expert"),
        ("{kind: dead, die: 5, iteration: 0}", 5, RING + EARLY, "vertical scaling: 3 -> 2 expert"),
    ],
)
def test_lost_dies_early_stuck_for_good_or_trampolines(
    tmp_path, request, row, die, settings, recovery
):
    _matrix_only(request)
    result, _, records = afd_served(tmp_path, [row], *settings)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == SERVED
    [record] = records
    assert_detected(record, die, "dead", CEILING_S if EARLY[0] in settings else 4)
    assert record.recovery.startswith(recovery), record.describe()


# Requests 0 and 1 go to dies 1 and 2 (DP domain 0) and end after 2 tokens; 2 and 3 keep dies 3
# and 4 (domain 1) busy for 24 (prompts alike: the balancer places them in order).
DOMAIN_0_DONE_EARLY = [(2, "The quick brown fox"), (2, "jumps over the lazy")] + [
    (24, "A long request keeps"),
    (24, "its domain busy for"),
]


@pytest.mark.long
def test_a_die_lost_while_another_domain_sits_the_iteration_out_numbers_events_alike(tmp_path):
    """Die 3 sticks for good inside its A2E at iteration 6, when domain 0 has no work left: the
    dies of domain 0 take their (empty) turn, count iteration 6 and wait in the agreement,
    while the fence undoes iteration 6 on domain 1 and the expert dies. The survivors rebuild
    on the highest count (AfdDieBase.rebuild), so that die 3's request, re-prefilled on domain
    0, meets the expert dies at the same event ids (without it: EventMismatch, domain 0 one
    iteration ahead)."""
    path = tmp_path / "requests.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": p, "max_tokens": n}) + "\n" for n, p in DOMAIN_0_DONE_EARLY)
    )
    workload = ["workload.source=jsonl", f"workload.path={path}"]
    row = "{kind: stuck, die: 3, iteration: 6}"
    result, _, records = afd_served(tmp_path, [row], *workload)
    out = result.stdout + result.stderr
    assert "EventMismatch" not in out, out[-3000:]
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == "check: 4 requests, 52 tokens, 0 mismatches"
    # A slow first iteration may draw a fence of its own (nobody lost): not this test's row.
    [record] = [r for r in records if r.die == 3]
    assert_detected(record, 3, "dead", timeout_s=8)
    assert record.recovery.startswith("vertical scaling: 4 -> 3 attention"), record.describe()
    assert record.requests_affected  # re-prefilled on domain 0, idle until then


# faults.on_timeout recompute: the dies' waits give up on the lost die after 1 s and vote; the
# TE-shell's fence ends the vote, and the survivors vote among themselves from then on.
RECOMPUTE = ["faults.on_timeout=recompute", "xccl.poll_timeout_s=1"]


@pytest.mark.parametrize(
    "row, die",
    [
        ("{kind: dead, die: 2, iteration: 5}", 2),
        ("{kind: stuck, die: 4, iteration: 3}", 4),  # for good: lost as dead
    ],
)
def test_a_lost_attention_die_with_timeouts_recomputed_is_scaled_away(tmp_path, row, die):
    result, _, records = afd_served(tmp_path, [row], *RECOMPUTE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == SERVED
    [record] = records
    assert_detected(record, die, "dead")
    assert record.recovery.startswith("vertical scaling: 4 -> 3 attention"), record.describe()


# Stuck 7 s: silent through detection and the first grace (lost: verdict stuck), back in the
# second; the die is scaled away all the same. Expert die 7 keeps a ring replica of each of its
# experts. With RECOMPUTE the peers' waits give up after 1 s and vote; the fence ends the vote.
LATE_2 = "{kind: stuck, die: 2, iteration: 5, duration_s: 7}"
LATE_7 = "{kind: stuck, die: 7, iteration: 5, duration_s: 7}"
LOST_OR_BACK_LATE = [
    (LATE_2, 2, "stuck", []),
    (LATE_2, 2, "stuck", RECOMPUTE),
    (LATE_7, 7, "stuck", RING),
    (LATE_7, 7, "stuck", RING + RECOMPUTE),
    ("{kind: dead, die: 7, iteration: 5}", 7, "dead", RING + RECOMPUTE),
    ("{kind: stuck, die: 7, iteration: 5}", 7, "dead", RING + RECOMPUTE),  # for good
]


@pytest.mark.failure_matrix
@pytest.mark.parametrize(
    "row, die, verdict, settings",
    LOST_OR_BACK_LATE,
    ids=[
        "attention-late-stop",
        "attention-late-recompute",
        "expert-late-stop",
        "expert-late-recompute",
        "expert-dead-recompute",
        "expert-stuck-recompute",
    ],
)
def test_a_die_back_late_or_lost_with_or_without_recompute_is_scaled_away(
    tmp_path, row, die, verdict, settings
):
    result, _, records = afd_served(tmp_path, [row], *settings)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == SERVED
    [record] = records
    assert_detected(record, die, verdict)
    scaled = "4 -> 3 attention dies" if die == 2 else "3 -> 2 expert dies"
    assert record.recovery.startswith(f"vertical scaling: {scaled}"), record.describe()


# Expert die 7 (no trampoline) stalls: 1.5 s under health.timeout_s 4, its peers waiting in
# their A2E/E2A; or 6 s under 12 with waits that give up after 3 s (the margins of
# test_an_a2e_wait_timed_out_on_a_slow_attention_die_is_recomputed) and recompute.
EXPERT_STALLS = [
    ("{kind: stuck, die: 7, iteration: 5, duration_s: 1.5}", [], "heartbeat"),
    (
        "{kind: stuck, die: 7, iteration: 5, duration_s: 6}",
        ["faults.on_timeout=recompute", "xccl.poll_timeout_s=3", "health.timeout_s=12"],
        "xccl timeout",
    ),
]


@pytest.mark.failure_matrix
@pytest.mark.parametrize("row, settings, found_by", EXPERT_STALLS, ids=["stop", "recompute"])
def test_an_expert_die_back_before_the_timeout_is_a_transient(tmp_path, row, settings, found_by):
    result, run_file, records = afd_served(tmp_path, [row], *settings)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED
    [record] = records  # nobody declared lost
    assert (record.kind, record.die, record.verdict) == ("stuck", 7, "transient")
    assert "silent for more than" not in out
    timeouts = run_file["summary"].attrs["xccl_timeouts"]
    if found_by == "xccl timeout":
        assert record.detected_by == "xccl timeout" and timeouts >= 1, record.describe()
        assert record.recovery.startswith("token recomputation"), record.describe()
    else:
        assert record.detection_s == -1 and timeouts == 0, record.describe()


def _matrix_only(request) -> None:
    if not request.config.getoption("--failure-matrix"):
        pytest.skip("the longer afd failure cases run with --failure-matrix")


def _afd(events, **sections):
    raw = yaml.safe_load((REPO_ROOT / "configs" / "afd.yaml").read_text())
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    cfg = config_from_dict({**raw, "faults": {"events": events}})
    check_failures(cfg, Topology.from_config(cfg))


@pytest.mark.parametrize("die, experts", [(5, [0, 1, 2, 3, 4, 5]), (6, [6, 7, 8, 9, 10])])
def test_ring_replicas_on_expert_dies_survive_the_loss_of_any_one(die, experts):
    from xds_mpi.eplb.placement import from_topology, remove_die
    from xds_mpi.eplb.ring import ring_placement

    raw = yaml.safe_load((REPO_ROOT / "configs" / "afd.yaml").read_text())
    raw["deployment"]["redundant_slots_per_die"] = 6
    topo = Topology.from_config(config_from_dict(raw))
    idx = topo.ranks[die].die_idx
    left = remove_die(ring_placement(topo, 3), idx)
    for layer in range(3):
        assert all(left.log2phy(layer)), f"layer {layer}: an expert without a slot"
        assert all(left.slot_die[s] != idx for row in left.log2phy(layer) for s in row)
    with pytest.raises(ValueError, match=re.escape(f"layer 0: experts {experts}")):
        remove_die(from_topology(topo, 3), idx)  # no ring: its experts live only there


def test_stuck_and_dead_rows_on_afd_dies_are_accepted():
    _afd([{"kind": "dead", "die": 2, "iteration": 3}])
    _afd([{"kind": "stuck", "die": 7, "iteration": 3, "duration_s": 1}])


@pytest.mark.parametrize(
    "events, sections, reason",
    [
        (
            [
                {"kind": "dead", "die": 2, "iteration": 3},
                {"kind": "stuck", "die": 5, "iteration": 0},
            ],
            {},
            r"faults.events\[0, 1\]: 2 stuck/dead rows in one afd run; one is emulated",
        ),
        (
            [{"kind": "dead", "die": 2, "iteration": 3}],
            {"deployment": {"dp_groups_per_domain": 1}},
            "attention die 2 is the only die of DP domain 1 .* losing a whole domain",
        ),
        (
            [{"kind": "dead", "die": 2, "iteration": 0}],
            {"health": {"enabled": False}},
            "found by heartbeats, and health.enabled is false",
        ),
        (
            [{"kind": "dead", "die": 6, "iteration": 0}],
            {"health": {"replicas": "ring"}},
            r"deployment.redundant_slots_per_die\(0\) must be >= 6",
        ),
    ],
)
def test_afd_rows_that_cannot_run_are_refused_with_a_reason(events, sections, reason):
    with pytest.raises(ConfigError, match=reason):
        _afd(events, **sections)


def test_a_pd_afd_attention_die_alone_in_its_domain_is_refused_as_without_pd():
    raw = yaml.safe_load((REPO_ROOT / "configs" / "pd_afd.yaml").read_text())
    attention = Topology.from_config(config_from_dict(raw)).ranks_with_role("attention")[0]
    raw["faults"] = {"events": [{"kind": "dead", "die": attention, "iteration": 1}]}
    raw["health"] = {"timeout_s": 4, "probe_timeout_s": 12}
    cfg = config_from_dict(raw)
    with pytest.raises(ConfigError, match="only die of DP domain 0 .* losing a whole domain"):
        check_failures(cfg, Topology.from_config(cfg))


@pytest.mark.failure_matrix
def test_a_kv_memory_fault_on_a_pd_afd_attention_die_ends_its_victims_and_nothing_else(tmp_path):
    """configs/pd_afd.yaml (JE 0, decode TE-shell 1, attention dies 2-3, expert dies 4-5,
    prefill die 6): attention die 2 loses KV blocks 0..7 at its 3rd iteration; the requests
    holding them end with the reason (the decode TE-shell's balancer hears them end), the rest
    are served equal to the reference."""
    row = "{kind: memory, die: 2, iteration: 3, first_block: 0, num_blocks: 8}"
    sets = ["workload.num_requests=6", "workload.ignore_eos=true", "run.trace=false"]
    result, run_file, records = served(tmp_path, [row], *sets, config="pd_afd")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [record] = records  # nothing else: no heartbeat or link verdict
    assert (record.kind, record.die, record.role) == ("memory", 2, "attention")
    assert (record.injected_iteration, record.detected_by) == (3, "memory check")
    victims = list(record.requests_lost)
    assert victims and record.verdict == "faulty KV blocks 0..7"
    requests = run_file["requests"]
    status = [s.decode() for s in requests["status"][()]]
    reasons = [s.decode() for s in requests["reason"][()]]
    assert [i for i, s in enumerate(status) if s == "lost"] == victims
    assert {reasons[i] for i in victims} == {"kv memory fault on die 2 blocks 0..7"}
    checked = 6 - len(victims)
    assert check_line(result) == (
        f"check: {checked} requests, {8 * checked} tokens, 0 mismatches; {len(victims)} lost, "
        f"not checked: {victims}"
    )


@pytest.mark.parametrize(
    "row, words",
    [
        ("{kind: memory, die: 4, iteration: 1, slot: 0}", "holds the only copy of routed expert"),
        ("{kind: memory, die: 4, iteration: 1, first_block: 0, num_blocks: 4}", "no KV blocks"),
    ],
)
def test_memory_faults_on_a_pd_afd_expert_die_are_refused_with_the_reason(row, words):
    raw = yaml.safe_load((REPO_ROOT / "configs" / "pd_afd.yaml").read_text())
    cfg = config_from_dict({**raw, "faults": {"events": [yaml.safe_load(row)]}})
    with pytest.raises(ConfigError, match=words):
        check_failures(cfg, Topology.from_config(cfg))


@pytest.mark.failure_cell("afd", "stuck")
def test_an_a2e_wait_timed_out_on_a_slow_attention_die_is_recomputed(tmp_path):
    """faults.on_timeout recompute on afd dies: attention die 2 stalls 6 s (under
    health.timeout_s 12, so no heartbeat verdict); trampoline 6's forward and the other dies'
    waits give up after 3 s and name die 2 (directly or through the dies they waited for), every
    die rolls back and recomputes the iteration; no other die is called slow.

    3 s, not 1: a die a loaded machine leaves without a core for more than the poll timeout
    times out first, on a die that is not stalled, and its record joins die 2's (seen at a load
    average of ~10 with 1 s). The stall, the poll timeout and the heartbeats' patience keep
    their order (poll timeout < stall < health.timeout_s) with seconds between them."""
    row = "{kind: stuck, die: 2, iteration: 5, duration_s: 6}"
    recompute = ["faults.on_timeout=recompute", "xccl.poll_timeout_s=3", "health.timeout_s=12"]
    result, run_file, records = afd_served(tmp_path, [row], *recompute)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert check_line(result) == SERVED
    assert run_file["summary"].attrs["xccl_timeouts"] >= 1
    # The die that times out first may wait for a trampoline that waits for die 2: the vote's
    # waits lead the blame to die 2 either way (xccl/recovery/vote.py Outcome.blamed).
    blamed = r"timed out waiting for die (2: xccl.poll_timeout_s|\d: xccl.poll_timeout_s; the "
    assert re.search(blamed + r"waits lead to die 2)", out), out[-3000:]
    [record] = records  # the stuck row's, found by the timeout; nobody declared lost
    assert (record.die, record.verdict, record.detected_by) == (2, "transient", "xccl timeout")
    assert "silent for more than" not in out
