"""Topology: ranks -> roles, die coordinates, DP domains/groups, expert slots, trampolines."""

from __future__ import annotations

from collections import Counter

import pytest

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.topology import Topology


def colocated(num_dies: int, **deployment):
    deployment = {"max_routed_experts_per_die": 256, **deployment}
    return config_from_dict(
        {
            "deployment": {"dp_groups_per_domain": num_dies, **deployment},
            "model": {"num_routed_experts": 256, "top_k": 8},
        }
    )


def afd(domains: int, groups: int, expert_dies: int, experts: int = 16, **deployment):
    return config_from_dict(
        {
            "deployment": {
                "kind": "afd",
                "num_dp_domains": domains,
                "dp_groups_per_domain": groups,
                "num_expert_dies": expert_dies,
                **deployment,
            },
            "model": {"num_routed_experts": experts},
        }
    )


@pytest.mark.parametrize(
    "die_idx, where",
    [
        (0, (0, 0, 0)),
        (1, (0, 0, 1)),
        (2, (0, 1, 0)),
        (15, (0, 7, 1)),
        (16, (1, 0, 0)),
        (17, (1, 0, 1)),
        (767, (47, 7, 1)),
    ],
)
def test_die_coordinates_follow_the_pod_shape(die_idx, where):
    topo = Topology.from_config(colocated(256, num_prefill_dies=512))
    info = topo.ranks[1 + die_idx]
    assert info.die_idx == die_idx
    assert (info.server, info.chip, info.die_in_chip) == where


@pytest.mark.parametrize("num_dies", [2, 3, 5, 16, 17, 100, 256])
def test_colocated_places_every_routed_expert_once_in_even_chunks(num_dies):
    topo = Topology.from_config(colocated(num_dies), 1 + num_dies)
    assert topo.ranks[0].role == "host"
    dies = topo.ranks[1:]
    assert [d.dp_group for d in dies] == list(range(num_dies))
    assert {d.dp_domain for d in dies} == {0}
    routed = [[s.expert_idx for s in d.expert_slots if s.kind == "routed"] for d in dies]
    assert sum(routed, []) == list(range(256))  # each once, in die order
    sizes = Counter(len(r) for r in routed)
    assert max(sizes) - min(sizes) <= 1
    assert all(sum(s.kind == "shared" for s in d.expert_slots) == 1 for d in dies)
    assert topo.log2phy() == tuple((e,) for e in range(256))


def test_dedicated_shared_dies_and_redundant_slots_like_ep288():
    cfg = colocated(
        288, shared_experts="dedicated", num_shared_expert_dies=32, redundant_slots_per_die=1
    )
    topo = Topology.from_config(cfg, 289)
    kinds = [tuple(s.kind for s in info.expert_slots) for info in topo.ranks[1:]]
    assert kinds[:256] == [("routed", "redundant")] * 256
    assert kinds[256:] == [("shared",)] * 32
    assert len(topo.phy2log) == 512
    assert topo.phy2log[:4] == (0, -1, 1, -1)


@pytest.mark.parametrize(
    "domains, groups, expert_dies", [(1, 2, 2), (2, 2, 3), (3, 2, 5), (2, 3, 4), (3, 160, 288)]
)
def test_afd_domains_groups_and_trampolines(domains, groups, expert_dies):
    pod = expert_dies > 16  # the paper's EP288: 256 routed-expert dies + 32 shared-expert dies
    shared = {"shared_experts": "dedicated", "num_shared_expert_dies": 32} if pod else {}
    topo = Topology.from_config(afd(domains, groups, expert_dies, 256 if pod else 16, **shared))
    attention = topo.ranks_with_role("attention")
    expert = topo.ranks_with_role("expert")
    assert len(attention) == domains * groups and len(expert) == expert_dies
    for d in range(domains):
        members = topo.domain_ranks(d)
        assert len(members) == groups
        assert [topo.ranks[r].dp_group for r in members] == [d * groups + g for g in range(groups)]
        # One trampoline per attention die of the domain, the leftmost expert dies, all distinct.
        assert [topo.trampoline_rank(r) for r in members] == list(expert[:groups])
    assert [topo.ranks[r].trampoline_for for r in expert] == (
        list(range(groups)) + [-1] * (expert_dies - groups)
    )
    assert all(not topo.ranks[r].expert_slots for r in attention)


def test_the_full_pod_fits_and_one_more_die_does_not():
    ep288 = {"shared_experts": "dedicated", "num_shared_expert_dies": 32}
    topo = Topology.from_config(afd(3, 160, 288, 256, **ep288))
    assert topo.num_dies == 768 and topo.ranks[-1].server == 47
    with pytest.raises(
        ConfigError,
        match=r"769 dies do not fit in one pod of 768 dies "
        r"\(48 servers x 8 chips x 2 dies\)",
    ):
        Topology.from_config(afd(3, 160, 289, 256, **ep288))


def test_wrong_world_size_names_every_count():
    with pytest.raises(ConfigError) as err:
        Topology.from_config(afd(2, 2, 3), 9)
    assert str(err.value) == (
        "world size 9 != num_host_ranks(1) + attention dies(4) + expert dies(3) = 8"
    )


def test_experts_that_do_not_fit_are_refused_with_the_numbers():
    with pytest.raises(
        ConfigError,
        match=r"do not fit into 3 routed-expert dies x "
        r"max_routed_experts_per_die\(4\) = 12 slots",
    ):
        Topology.from_config(afd(1, 2, 3, 16, max_routed_experts_per_die=4))
    with pytest.raises(
        ConfigError, match=r"20 routed-expert dies > model.num_routed_experts\(16\)"
    ):
        Topology.from_config(afd(1, 2, 20, 16))
    with pytest.raises(ConfigError, match=r"num_shared_expert_dies\(3\) leaves no die"):
        Topology.from_config(afd(1, 2, 3, 16, shared_experts="dedicated", num_shared_expert_dies=3))


def test_a_non_attention_rank_has_no_trampoline():
    topo = Topology.from_config(afd(1, 2, 2))
    with pytest.raises(ValueError, match="rank 3 is a expert rank"):
        topo.trampoline_rank(3)
