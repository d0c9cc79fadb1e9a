"""Memory faults on disaggregated MoE-attention dies (xDeepServe §6.2 stage 3, configs/afd.yaml:
TE-shell rank 0, attention dies 1-4, expert dies 5-7). An attention die holds the KV cache: a KV
block row there ends the requests whose KV had a block in the range, and nothing else. An expert
die holds the expert slots: a slot row whose expert keeps a ring replica is dropped from the
attention dies' routing, its weights turn to NaN, and every token still equals the reference.
Rows that cannot run are refused before launch, naming why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml
from harness import REPO_ROOT
from test_decode_failover import served
from test_serving import check_line

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology

# One request per attention die keeps each run short (request i goes to attention die i + 1).
LEAN = ["run.trace=false", "workload.num_requests=4"]
# Each expert die's 6 redundant slots hold the next expert die's routed experts. Expert die
# rank 6: slots 0-4 routed experts 6-10 (physical 12-16); expert die rank 5's redundant slots
# (physical 6-11) hold their copies. Expert die rank 7: slot 5 (physical 28) holds the copy of
# expert 0, whose routed slot is physical 0 on rank 5.
RING = ["deployment.redundant_slots_per_die=6", "health.replicas=ring"]
RING_SECTIONS = {"deployment": {"redundant_slots_per_die": 6}, "health": {"replicas": "ring"}}


@pytest.mark.failure_cell("afd", "memory")
def test_a_kv_memory_fault_on_an_attention_die_ends_its_request_and_nothing_else(tmp_path):
    # Attention die 2 serves request 1 alone; its 3 KV blocks lie in 0..7.
    assert_request_1_ends(tmp_path)


@pytest.mark.failure_matrix  # the fault alone runs by default (the lean matrix's case above)
@pytest.mark.parametrize(
    "settings",
    [["faults.on_timeout=recompute", "xccl.poll_timeout_s=1"], ["scheduler.mtp_depth=1"]],
    ids=["recompute", "mtp"],
)
def test_a_kv_memory_fault_with_recompute_or_mtp_ends_its_request_only(tmp_path, settings):
    """Beside timeouts recomputed, and with MTP drafts (their KV in the same blocks)."""
    assert_request_1_ends(tmp_path, *settings)


def assert_request_1_ends(tmp_path, *settings: str) -> None:
    row = "{kind: memory, die: 2, iteration: 3, first_block: 0, num_blocks: 8}"
    result, run_file, records = served(tmp_path, [row], *LEAN, *settings, config="afd")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [record] = records
    assert (record.kind, record.die, record.role) == ("memory", 2, "attention")
    assert (record.injected_iteration, record.detected_by) == (3, "memory check")
    assert record.requests_lost == (1,) and record.verdict == "faulty KV blocks 0..7"
    requests = run_file["requests"]
    status = [s.decode() for s in requests["status"][()]]
    reasons = [s.decode() for s in requests["reason"][()]]
    assert [i for i, s in enumerate(status) if s == "lost"] == [1]
    assert reasons[1] == "kv memory fault on die 2 blocks 0..7"
    assert (
        check_line(result) == "check: 3 requests, 48 tokens, 0 mismatches; 1 lost, not checked: [1]"
    )


# the colocated case runs by default (tests/e2e/failover/test_slot_faults.py)
@pytest.mark.failure_matrix
def test_a_routed_and_a_redundant_expert_slot_are_masked_and_the_tokens_equal_the_reference(
    tmp_path,
):
    # Either slot still taking rows after its mask would break the check (its weights are NaN).
    rows = [
        "{kind: memory, die: 6, iteration: 3, slot: 1}",
        "{kind: memory, die: 7, iteration: 6, slot: 5}",
    ]
    result, run_file, records = served(tmp_path, rows, *LEAN, *RING, config="afd")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 4 requests, 64 tokens, 0 mismatches"
    routed, redundant = sorted(records, key=lambda r: r.injected_iteration)
    assert (routed.die, routed.role, routed.injected_iteration) == (6, "expert", 3)
    assert routed.verdict == "faulty expert slot 1 (physical slot 13, expert 7)"
    assert routed.recovery.startswith(
        "slot masked: expert 7 served by its replica at physical slot(s) [7]"
    )
    assert (redundant.die, redundant.injected_iteration) == (7, 6)
    assert redundant.verdict == "faulty expert slot 5 (physical slot 28, expert 0)"
    assert "physical slot(s) [0]" in redundant.recovery
    assert not routed.requests_lost and not redundant.requests_lost
    status = [s.decode() for s in run_file["requests"]["status"][()]]
    assert "lost" not in status


def _expert_die(slot_expert: dict[int, int]):
    """An expert die's parts that AfdSlots.corrupt and ExpertDie._compute use, no MPI."""
    from contextlib import nullcontext

    from xds_mpi.eplb.placement import Placement
    from xds_mpi.model.weights import build_model

    cfg = config_from_dict(yaml.safe_load((REPO_ROOT / "configs" / "afd.yaml").read_text()))
    model = build_model(cfg.model)
    moe_layers = tuple(i for i, layer in enumerate(model.layers) if layer.is_moe)
    row = tuple(slot_expert.get(s, -1) for s in range(max(slot_expert) + 1))
    placement = Placement(
        phy2log=(row,),
        slot_die=(0,) * len(row),
        is_redundant=(False,) * len(row),
        num_experts=cfg.model.num_routed_experts,
    )
    from xccl.vclock import VirtualClock
    from xds_mpi.afd.load import ExpertLoad

    pricer = SimpleNamespace(expert_slot=lambda *a, **k: None, mtp_layer=nullcontext, moe_scale=1.0)
    load = ExpertLoad(
        rank=0,
        slots=tuple(range(len(row))),
        is_routed=(True,) * len(row),
        topk_scale=1.0,
        experts_per_slot=1.0,
    )
    return SimpleNamespace(
        clock=VirtualClock(),  # the die's clock and measured load (xds_mpi/afd/load.py)
        load=load,
        iteration=0,
        model=model,
        placement=placement,
        plan=SimpleNamespace(moe_layers=moe_layers),
        slots=SimpleNamespace(num_routed_slots=len(row)),
        layer_of={0: moe_layers[0]},
        faulty={},
        pricer=pricer,
    )


def test_a_faulty_slot_computes_nan_and_another_slot_of_its_expert_does_not():
    import numpy as np

    from ranks.afd.expert import ExpertDie
    from ranks.recovery.memory import AfdSlots

    die = _expert_die({0: 3, 1: 3})  # one expert in two slots of the die
    AfdSlots.corrupt(die, 0)
    assert sorted(die.faulty) == [(layer, 0) for layer in die.plan.moe_layers]
    rows = np.ones((2, die.model.cfg.hidden), np.float32)
    call = SimpleNamespace(call=0)
    assert np.isnan(ExpertDie._compute(die, call, 0, rows)).all()
    assert np.isfinite(ExpertDie._compute(die, call, 1, rows)).all()


def _afd(events, raw_name: str = "afd.yaml", **sections):
    raw = yaml.safe_load((REPO_ROOT / "configs" / raw_name).read_text())
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    cfg = config_from_dict({**raw, "faults": {"events": events}})
    check_failures(cfg, Topology.from_config(cfg))


def test_kv_rows_on_attention_dies_and_ring_slots_on_expert_dies_are_accepted():
    _afd([{"kind": "memory", "die": 1, "iteration": 0, "first_block": 0, "num_blocks": 4}])
    _afd(
        [
            {"kind": "memory", "die": 6, "iteration": 0, "slot": 1},
            {"kind": "memory", "die": 7, "iteration": 0, "slot": 5},
        ],
        **RING_SECTIONS,
    )


@pytest.mark.parametrize(
    "events, sections, reason",
    [
        (
            [{"kind": "memory", "die": 6, "iteration": 0, "slot": 1}],
            {},
            "slot 1 of die 6 holds the only copy of routed expert 7",
        ),
        (
            # expert 7: routed on rank 6 (slot 1), its ring copy on rank 5 (slot 7)
            [
                {"kind": "memory", "die": 6, "iteration": 0, "slot": 1},
                {"kind": "memory", "die": 5, "iteration": 0, "slot": 7},
            ],
            RING_SECTIONS,
            r"hold every replica of routed expert\(s\) \[7\]",
        ),
        (
            [{"kind": "memory", "die": 5, "iteration": 0, "slot": 12}],
            RING_SECTIONS,
            "holds shared expert 0",
        ),
        (
            # rank 6's sixth redundant slot: rank 7 has 5 routed experts to copy
            [{"kind": "memory", "die": 6, "iteration": 0, "slot": 10}],
            RING_SECTIONS,
            "slot 10 of die 6 is a redundant slot holding no expert",
        ),
        (
            [{"kind": "memory", "die": 6, "iteration": 0, "first_block": 0, "num_blocks": 4}],
            {},
            "expert die and holds no KV blocks",
        ),
        (
            [{"kind": "memory", "die": 2, "iteration": 0, "slot": 0}],
            {},
            r"rank 2 \(attention\) has 0 expert slots",
        ),
        (
            [
                {"kind": "memory", "die": 2, "iteration": 0, "first_block": 0, "num_blocks": 4},
                {"kind": "dead", "die": 3, "iteration": 5},
            ],
            {},
            "KV blocks of die 2\\) beside 1 stuck/dead row\\(s\\) in one afd run is refused",
        ),
        (
            [
                {"kind": "memory", "die": 6, "iteration": 0, "slot": 1},
                {"kind": "stuck", "die": 2, "iteration": 5},
            ],
            RING_SECTIONS,
            "slot 1 of die 6\\) beside 1 stuck/dead row\\(s\\) in one afd run is refused",
        ),
    ],
)
def test_afd_memory_rows_that_cannot_run_are_refused_naming_why(events, sections, reason):
    with pytest.raises(ConfigError, match=reason):
        _afd(events, **sections)


def test_a_kv_row_on_a_pd_attention_die_is_accepted_alone_and_refused_beside_a_loss():
    raw = yaml.safe_load((REPO_ROOT / "configs" / "pd_afd.yaml").read_text())
    attention = Topology.from_config(config_from_dict(raw)).ranks_with_role("attention")[0]
    row = {"kind": "memory", "die": attention, "iteration": 0, "first_block": 0, "num_blocks": 4}
    _afd([row], "pd_afd.yaml")  # tests/e2e/failover/test_afd_failover.py serves it
    lost = {"kind": "dead", "die": attention + 1, "iteration": 2}
    one_domain = {"num_dp_domains": 1, "dp_groups_per_domain": 2}
    health = {"timeout_s": 4, "probe_timeout_s": 12}
    with pytest.raises(ConfigError, match="beside 1 stuck/dead row"):
        _afd([row, lost], "pd_afd.yaml", deployment=one_domain, health=health)
