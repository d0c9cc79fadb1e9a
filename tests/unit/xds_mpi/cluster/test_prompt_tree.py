"""The JE's prompt tree (xds_mpi/cluster/prompt_tree.py) against known answers: a shared prefix
is matched in whole blocks before the prompt's last token, a TE matches only what was routed to
it, and a TE past its capacity drops its least recently used blocks."""

from __future__ import annotations

import pytest

from xds_mpi.cluster.prompt_tree import PromptTree, te_capacity_blocks
from xds_mpi.config.schema import load_config
from xds_mpi.workload.requests import Request

BT = 4  # tokens per block


def _req(req_id: int, *blocks: int, tail: int = 0) -> Request:
    """A prompt of BT-token blocks, block b made of tokens b*10..b*10+3, plus `tail` tokens."""
    prompt = [b * 10 + i for b in blocks for i in range(BT)] + [999] * tail
    return Request(req_id=req_id, prompt=tuple(prompt), max_new_tokens=1)


def test_a_shared_prefix_is_matched_in_whole_blocks_on_the_te_that_holds_it():
    tree = PromptTree(2, block_tokens=BT, capacity_blocks=100)
    tree.route(_req(0, 1, 2, 3), te=0)
    assert tree.num_held(0) == 3 and tree.num_held(1) == 0
    assert tree.matched_tokens(_req(1, 1, 2, 3, tail=1), 0) == 3 * BT  # all three, then 1 token
    assert tree.matched_tokens(_req(2, 1, 2, 3), 0) == 2 * BT  # the last block holds the last token
    assert tree.matched_tokens(_req(3, 1, 2, 7, 8), 0) == 2 * BT  # diverges at block 2
    assert tree.matched_tokens(_req(4, 9, 2, 3, 4), 0) == 0  # block 0 differs: no chain matches
    assert tree.matched_tokens(_req(5, 1, 2, 3, tail=1), 1) == 0  # TE 1 was given nothing
    tree.route(_req(6, 1, 2, 5), te=1)
    assert tree.holders[tree.keys(_req(7, 1, 2))[1]] == {0, 1}  # block (1, 2) on both TEs
    assert tree.matched_tokens(_req(8, 1, 2, 3, tail=2), 1) == 2 * BT


def test_a_te_at_capacity_evicts_its_least_recently_used_blocks():
    tree = PromptTree(2, block_tokens=BT, capacity_blocks=4)
    tree.route(_req(0, 1, 2), te=0)  # held: (1) (1,2)
    tree.route(_req(1, 5, 6), te=0)  # held: (1) (1,2) (5) (5,6)
    tree.route(_req(2, 1, 2), te=0)  # (1) (1,2) used again: the oldest are (5) (5,6)
    tree.route(_req(3, 7), te=0)  # a fifth block: (5) goes
    assert tree.num_held(0) == 4 and tree.num_evicted[0] == 1
    assert tree.matched_tokens(_req(4, 5, 6, tail=1), 0) == 0  # its first block went: no chain
    assert tree.matched_tokens(_req(5, 1, 2, tail=1), 0) == 2 * BT
    tree.route(_req(6, 8, 9), te=0)  # two more: (5,6) and (1) go
    assert tree.num_evicted[0] == 3
    assert tree.matched_tokens(_req(7, 1, 2, tail=1), 0) == 0  # (1,2) is held, (1) is not
    assert all(0 not in tree.holders.get(k, ()) for k in tree.keys(_req(8, 5, 6)))
    tree.route(_req(9, 5, 6), te=1)  # another TE's capacity is its own
    assert tree.num_evicted[1] == 0 and tree.matched_tokens(_req(10, 5, 6, tail=1), 1) == 2 * BT


def test_the_capacity_is_the_te_s_pool_with_ems_else_its_kv_blocks():
    ems = load_config(
        "configs/colocated.yaml",
        ["ems.enabled=true", "ems.servers=2", "ems.capacity_blocks=300"],
    )
    assert te_capacity_blocks(ems, num_dies=2) == 600
    plain = load_config("configs/colocated.yaml", ["scheduler.num_kv_blocks_per_die=128"])
    assert te_capacity_blocks(plain, num_dies=2) == 256
    tree = PromptTree(2, block_tokens=BT, capacity_blocks=[600, 256])
    assert tree.max_blocks == (600, 256)
    with pytest.raises(ValueError, match=r"capacity_blocks \[4\] must be >= 1 for each of 2 TEs"):
        PromptTree(2, block_tokens=BT, capacity_blocks=[4])
