"""DeploymentPlan: the shipped configs build at their world sizes, windows agree with the layouts,
and every config that cannot run is refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
from harness import REPO_ROOT

from xds_mpi.config.schema import ConfigError, config_from_dict, load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.fabric import p2p_pairs
from xds_mpi.workload.requests import rejection
from xds_mpi.workload.stream import load_workload

SHIPPED = {"colocated": 5, "afd": 8, "ep288": 289, "afd_pod": 769}


def shipped(name: str, overrides=()):
    return load_config(REPO_ROOT / "configs" / f"{name}.yaml", overrides)


def expected_windows(plan: DeploymentPlan) -> list[int]:
    """What the layouts say: the p2p area, then the MoE area from each member's base."""
    sizes = [plan.p2p.window_bytes(rank) for rank in range(plan.topo.world_size)]
    if plan.ep is not None:
        for rank in plan.ep.members:
            sizes[rank] = plan.ep.base[rank] + plan.ep.area_bytes()
    if plan.afd is not None:
        for rank in plan.afd.attention + plan.afd.experts:
            sizes[rank] = plan.afd.base[rank] + plan.afd.area_bytes(plan.afd.role_of(rank))
    return sizes


@pytest.mark.parametrize("name, world_size", SHIPPED.items())
def test_shipped_configs_build_and_windows_match_the_layouts(name, world_size):
    plan = DeploymentPlan.build(shipped(name), world_size)
    assert plan.topo.world_size == world_size == len(plan.window_bytes)
    assert list(plan.window_bytes) == expected_windows(plan)
    assert all(plan.window_bytes[r] == 0 for r in range(plan.topo.num_host_ranks))
    moe = plan.ep if plan.cfg.deployment.kind == "colocated" else plan.afd
    assert (plan.ep is None) != (plan.afd is None)
    assert moe.base == tuple(plan.p2p.window_bytes(r) for r in range(world_size))
    assert moe.itemsize == plan.row_dtype.itemsize == 8
    assert max(plan.window_bytes) <= plan.cfg.xccl.max_window_bytes
    assert DeploymentPlan.build(shipped(name)) == plan  # world size None: what it needs


def test_p2p_pairs_follow_the_declaration():
    cfg = config_from_dict(
        {
            "deployment": {"dp_groups_per_domain": 3, "num_prefill_dies": 2},
            "xccl": {"p2p_pairs": "prefill_to_decode", "ring_slots": 2, "slot_bytes": 1024},
        }
    )
    plan = DeploymentPlan.build(cfg)
    assert p2p_pairs(cfg, plan.topo) == {(p, d) for p in (4, 5) for d in (1, 2, 3)}
    sizes, ep = plan.window_bytes, plan.ep
    assert sizes[0] == 0  # the TE-shell holds no die memory
    assert ep.members == (1, 2, 3) and ep.base[1] == 64 * 2 * 2 + 2 * 2 * 1024
    # 2 senders: 2 records each + a ring each, then the dispatch/combine area
    assert sizes[1] == 64 * 2 * 2 + 2 * 2 * 1024 + ep.area_bytes()
    assert sizes[4] == 64 * 3  # 3 receivers: one ack word each


@pytest.mark.parametrize(
    "settings, message",
    [
        (["scheduler.mtp_depth=1", "model.num_mtp_modules=0"], "needs a model with MTP modules"),
        (["scheduler.mtp_depth=2", "xccl.max_tokens_per_die=3"], "needs >= 4"),
        (["faults.table=[{die: 0, op: dispatch, layer: 1, iteration: 0}]"], "is not a die"),
        (["faults.table=[{die: 1, op: combine, layer: 0, iteration: 0}]"], "is not a MoE layer"),
        (["faults.table=[{die: 1, op: combine, layer: 4, iteration: 0}]"], "is not a MoE layer"),
        (["faults.table=[{die: 1, op: p2p_send, layer: 1, iteration: 0}]"], "makes no p2p"),
    ],
)
def test_mtp_and_fault_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        DeploymentPlan.build(config_from_dict({}, settings))


@pytest.mark.parametrize(
    "settings, world_size, message",
    [
        ([], 7, r"world size 7 != num_host_ranks\(1\) \+ colocated dies\(4\) = 5"),
        (
            ["deployment.max_routed_experts_per_die=3"],
            None,
            r"do not fit into 4 routed-expert dies x max_routed_experts_per_die\(3\) = 12 slots",
        ),
        (
            ["xccl.p2p_pairs=all", "xccl.max_window_bytes=100000"],
            None,
            r"rank 1's window needs 2642624 B = p2p 2097920 B \+ dispatch/combine 544704 B, "
            r"over the per-die cap xccl.max_window_bytes\(100000\)",
        ),
        (["xccl.slot_bytes=12"], None, r"xccl: .*slot_bytes\(12\) a positive multiple of 8"),
        (
            ["model.max_seq_len=40"],
            None,
            r"none of the 8 requests can be served; the first: "
            r"prompt\(32\) \+ max_new_tokens\(16\) = 48 > model.max_seq_len\(40\)",
        ),
    ],
)
def test_what_cannot_run_is_refused_with_the_reason(settings, world_size, message):
    with pytest.raises(ConfigError, match=message):
        DeploymentPlan.build(config_from_dict({}, settings), world_size)


def test_the_ranks_leave_the_workload_to_the_launcher():
    """A rank's plan (launch/job/rank.py: launcher_checks=False) skips the workload check the
    launcher made; the launcher's refuses the same config."""
    cfg = config_from_dict({}, ["model.max_seq_len=40"])
    assert DeploymentPlan.build(cfg, 5, launcher_checks=False).topo.world_size == 5
    with pytest.raises(ConfigError, match="none of the 8 requests can be served"):
        DeploymentPlan.build(cfg, 5)


def test_a_workload_with_some_servable_requests_is_accepted():
    cfg = config_from_dict(
        {},
        [
            "model.max_seq_len=40",
            "workload.length_dist=uniform",
            "workload.prompt_len=8",
            "workload.output_len=8",
        ],
    )
    reasons = [rejection(req, cfg) for req in load_workload(cfg)]
    assert any(reasons) and not all(reasons)  # the frontend rejects those; the rest are served
    assert DeploymentPlan.build(cfg).topo.world_size == 5


@pytest.mark.parametrize("kind", ["colocated", "afd"])
def test_the_row_dtype_sizes_the_layout_and_the_dies_buffers(kind):
    # One source of truth: the layout's rows and the dtype the dies give their XCCL buffer.
    plan = DeploymentPlan.build(
        config_from_dict(
            {"deployment": {"kind": kind, "num_expert_dies": 4 if kind == "afd" else 0}},
            ["xccl.row_dtype=float32"],
        )
    )
    layout = plan.ep if kind == "colocated" else plan.afd
    assert plan.row_dtype == np.float32 and layout.itemsize == 4
    assert layout.out_row_bytes == plan.cfg.model.hidden * 4


def test_a_checkpoint_of_another_model_shape_is_refused_before_launch():
    # model.weights: tiny was trained at hidden 128: a rank would die loading it after launch.
    with pytest.raises(ConfigError) as refused:
        DeploymentPlan.build(shipped("colocated", ["model.hidden=7", "model.num_heads=2"]))
    message = str(refused.value)
    assert "model.hidden: checkpoint 128 vs config 7" in message
    assert "model.num_heads: checkpoint 4 vs config 2" in message
    assert "model.weights=random" in message and "train-tiny" in message
    random = shipped("colocated", ["model.hidden=7", "model.weights=random"])
    assert DeploymentPlan.build(random).cfg.model.hidden == 7


def test_a_missing_checkpoint_is_refused_before_launch(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DeploymentPlan.build(shipped("colocated", [f"model.weights={tmp_path}/none.h5"]))
