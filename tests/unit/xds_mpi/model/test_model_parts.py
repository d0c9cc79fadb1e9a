"""Paged KV bookkeeping against hand-computed slot maps, the byte tokenizer's round trip, and the
model presets against DeepSeek-V3's published dimensions."""

from __future__ import annotations

import dataclasses

import pytest

from xds_mpi.config.schema import ConfigError, ModelConfig
from xds_mpi.model.kv_blocks import BlockTable, KVCacheFull
from xds_mpi.model.shapes import compute_shape, cost_shape, load_model_preset
from xds_mpi.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer


def test_allocate_append_truncate_free_bookkeeping():
    table = BlockTable(num_blocks=4, block_tokens=4)
    assert table.allocate("a", 5) == [0, 1, 2, 3, 4]  # blocks 0, 1
    assert table.allocate("b", 2) == [8, 9]  # block 2
    assert table.append("a", 4) == [5, 6, 7, 12]  # fills block 1, takes block 3
    assert table.blocks("a") == [0, 1, 3] and table.num_free_blocks == 0
    assert table.append("b", 2) == [10, 11]  # fits in block 2
    table.truncate("a", 6)  # rollback frees block 3
    assert table.blocks("a") == [0, 1] and table.seq_len("a") == 6 and table.num_free_blocks == 1
    assert table.slots("a") == [0, 1, 2, 3, 4, 5]
    table.free("a")
    assert table.num_free_blocks == 3 and not table.has("a")
    assert table.allocate("c", 9) == [0, 1, 2, 3, 4, 5, 6, 7, 12]


def test_running_out_of_blocks_names_the_numbers_and_changes_nothing():
    table = BlockTable(num_blocks=3, block_tokens=16)
    table.allocate(0, 20)
    assert table.can_append(0, 28) and not table.can_append(0, 29)
    with pytest.raises(
        KVCacheFull,
        match=r"sequence 0 at 20 tokens needs 2 more block\(s\) of "
        r"16 tokens for 29 new tokens, but only 1 of 3 blocks",
    ):
        table.append(0, 29)
    assert table.seq_len(0) == 20 and table.num_free_blocks == 1
    with pytest.raises(KVCacheFull, match=r"only 1 of 3 blocks are free"):
        table.allocate(1, 17)
    assert not table.has(1) and table.num_free_blocks == 1


def test_bookkeeping_mistakes_are_refused():
    table = BlockTable(num_blocks=2, block_tokens=4)
    table.allocate(7, 3)
    with pytest.raises(ValueError, match="already allocated"):
        table.allocate(7, 1)
    with pytest.raises(ValueError, match="truncate sequence 7 of 3 tokens to 4"):
        table.truncate(7, 4)
    with pytest.raises(KeyError, match="sequence 8 has no KV blocks"):
        table.append(8, 1)
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockTable(num_blocks=0, block_tokens=4)


@pytest.mark.parametrize("text", ["", "hello, world", "héllo ✓ 日本語", "tabs\tand\nnewlines"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids + [EOS_ID, PAD_ID]) == text
    assert max(ids) < 260


def test_tokenizer_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        ByteTokenizer().decode([65, 260])
    with pytest.raises(ValueError, match="vocab_size >= 256 bytes"):
        ByteTokenizer(100)


def test_presets():
    # The tiny preset is the ModelConfig defaults plus the trained checkpoint as its weights.
    assert compute_shape() == dataclasses.replace(ModelConfig(), weights="tiny")
    published = dict(
        vocab_size=129280,
        hidden=7168,
        num_layers=61,
        num_dense_layers=3,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        intermediate=18432,
        moe_intermediate=2048,
        num_routed_experts=256,
        num_shared_experts=1,
        top_k=8,
        num_expert_groups=8,
        topk_groups=4,
        routed_scaling=2.5,
        num_mtp_modules=1,
    )
    cost = cost_shape()
    assert {k: getattr(cost, k) for k in published} == published
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.hidden = 1
    with pytest.raises(ConfigError, match="model preset 'nope' is neither a file nor a name"):
        load_model_preset("nope")


def test_preset_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hiden: 64\n")
    with pytest.raises(ConfigError, match="unknown key 'hiden' in section 'model'"):
        load_model_preset(path)
