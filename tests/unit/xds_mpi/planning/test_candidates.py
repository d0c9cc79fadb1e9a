"""Enumeration on crafted cases: what does not fit is excluded, naming why."""

from __future__ import annotations

import pytest

from xds_mpi.config.schema import ConfigError
from xds_mpi.model.shapes import load_model_preset
from xds_mpi.planning.candidates import Enumerator, Options
from xds_mpi.planning.memory import ModelBytes

GB = 1e9


def enumerator(num_dies: int, context_len: int, **kw) -> Enumerator:
    return Enumerator(
        load_model_preset("deepseek_v3"),
        num_dies=num_dies,
        hbm=64 * GB,
        weight_bytes=1,
        context_len=context_len,
        max_prompt=context_len,
        **kw,
    )


def test_model_bytes_match_deepseek_v3_published_size():
    mb = ModelBytes.of(load_model_preset("deepseek_v3"))
    total = mb.attention + mb.dense_ffn + (256 + 1) * mb.expert
    # DeepSeek-V3: 671 B parameters of the main model + 14 B of the MTP module = 685 B
    assert 660e9 < total < 700e9
    # the latent cache: (61 + 1) layers x (512 + 64) values x 2 bytes = 71,424 bytes per token
    assert mb.kv_token_bf16 == 62 * 576 * 2


def test_ep32_holds_a_short_batch_but_not_a_long_one_and_says_why():
    opts = Options(mtp_depths=(0,), kv_int8=(False,), max_batches=(96,))
    e = enumerator(32, context_len=1024)  # EP32: 9 experts, ~38.6 GB of weights; 7 GB of KV
    e.run(("colocated",), opts)
    assert [c.label for c in e.kept] == ["EP32 b96 mtp0"]
    # EP16 holds 17 experts: 59 GB of weights, over 64 GB with any KV and the reserve
    assert [(x.label, x.reason) for x in e.excluded] == [
        (
            "EP16 b96 mtp0",
            "decode die memory: weights 59.0 GB + KV 7.0 GB + reserve 4 GB = 70.0 GB > HBM 64 GB",
        )
    ]
    e = enumerator(32, context_len=16384)  # 96 x 16K tokens of KV: 112 GB
    e.run(("colocated",), opts)
    assert not e.kept
    assert e.excluded[1].label == "EP32 b96 mtp0"
    assert "KV 112.3 GB" in e.excluded[1].reason


def test_the_largest_batch_that_fits_is_kept():
    opts = Options(mtp_depths=(0,), kv_int8=(False, True), max_batches=(16, 32, 64, 96))
    e = enumerator(32, context_len=12500)  # 0.89 GB of KV a slot in BF16, 0.5 GB in INT8
    e.run(("colocated",), opts)
    assert [c.label for c in e.kept] == ["EP32 b16 mtp0", "EP32 b32 mtp0 kv8"]


def test_afd_needs_a_trampoline_per_attention_die_and_the_budget_bounds_everything():
    opts = Options(mtp_depths=(0,), kv_int8=(False,), max_batches=(16,))
    e = enumerator(768, context_len=1024)
    e.run(("afd",), opts)
    assert e.kept and all(c.num_dies <= 768 for c in e.kept)
    reasons = {x.reason for x in e.excluded if "trampoline" in x.reason}
    assert (
        "afd needs one trampoline expert die per attention die of a domain: expert dies 32 "
        "< attention dies per domain 64" in reasons
    )


def test_dead_zone_excludes_the_expert_dies_it_names():
    opts = Options(mtp_depths=(0,), kv_int8=(False,), max_batches=(16,))
    e = enumerator(768, context_len=1024, dead_zone=lambda n: "dead zone" if n == 64 else "")
    e.run(("afd",), opts)
    assert not [c for c in e.kept if "num_expert_dies=64" in " ".join(c.sets)]
    assert any(x.reason == "dead zone" for x in e.excluded)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="'mixed' is not one of colocated, pd, afd"):
        enumerator(32, 1024).run(("mixed",), Options())
