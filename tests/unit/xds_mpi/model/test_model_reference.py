"""The reference generator: MTP against plain greedy decoding, batched against alone, weight
files against the in-memory model, INT8 and float32 against float64, sampling against softmax."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from xds_mpi.config.schema import ConfigError, ModelConfig
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.sampling import verify_drafts
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.model.transformer import DeepSeekModel
from xds_mpi.model.weights import build_model, load_model, save_weights

TOKENIZER = ByteTokenizer()
PROMPTS = [
    TOKENIZER.encode(text)
    for text in [
        "The quick brown fox jumps over",
        "abc",
        "MoE",
        "hello, world: a longer prompt here",
    ]
]


def _generate(model, prompts=PROMPTS, **options):
    opts = GenerateOptions(
        max_new_tokens=options.pop("max_new_tokens", 20), ignore_eos=True, **options
    )
    return ReferenceGenerator(model, opts).generate(prompts)


def _mtp_agreeing(model, alpha: float) -> DeepSeekModel:
    """Main model: scale every attention / FFN / expert output projection by alpha, so the hidden
    state is Emb(t_i) plus alpha x context and the model is nearly a bigram map f(t_i).
    MTP module k: eh_proj = [0 | I] keeps only RMSNorm(Emb(t_{i+k})), its block's output
    projections are zero and its norm copies the main final norm, so it predicts f(t_{i+k}):
    exactly the main model's next token when alpha = 0, usually it when alpha is small."""
    hidden = model.cfg.hidden
    state = {name: value.copy() for name, value in model.state_dict().items()}
    for name, value in state.items():
        is_output = name.endswith(("attn.wo.weight", "w2.weight"))
        if name.startswith("layers.") and is_output:
            value *= alpha
        elif name.startswith("mtp.") and (is_output or name.endswith("eh_proj.weight")):
            value[:] = 0
            if name.endswith("eh_proj.weight"):
                value[:, hidden:] = np.eye(hidden)
        elif name.startswith("mtp.") and name.count(".") == 2 and name.endswith(".norm.weight"):
            value[:] = state["norm.weight"]
    return DeepSeekModel(model.cfg, state)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(num_mtp_modules=2))


@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.0], ids=["agreeing", "mostly_agreeing", "random"])
@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_mtp_gives_the_tokens_of_plain_greedy(depth, alpha):
    """alpha 0: every draft must be accepted; 0.2: some accepted, some rejected (rollback);
    1.0: random weights, drafts almost always rejected."""
    model = _mtp_agreeing(build_model(ModelConfig(num_mtp_modules=2)), alpha)
    plain = _generate(model)
    with_mtp = _generate(model, mtp_depth=depth)
    assert [o.tokens for o in with_mtp] == [o.tokens for o in plain]
    num_drafted = sum(o.num_drafted for o in with_mtp)
    num_accepted = sum(o.num_accepted for o in with_mtp)
    if alpha == 0.0:
        assert num_accepted == num_drafted > 0
        assert max(o.num_steps for o in with_mtp) < max(o.num_steps for o in plain)
    elif alpha == 0.2:
        assert 0 < num_accepted < num_drafted


def test_mtp_depth_two_reuses_a_single_module(model):
    single = build_model(dataclasses.replace(model.cfg, num_mtp_modules=1))
    assert [o.tokens for o in _generate(single, mtp_depth=2)] == [
        o.tokens for o in _generate(single)
    ]


@pytest.mark.parametrize("depth", [0, 2])
def test_batched_decode_equals_each_request_alone(model, depth):
    batched = _generate(
        model, mtp_depth=depth, max_new_tokens=12, block_tokens=4, record_logits=True
    )
    for prompt, out in zip(PROMPTS, batched):
        [alone] = _generate(
            model, [prompt], mtp_depth=depth, max_new_tokens=12, block_tokens=4, record_logits=True
        )
        assert out.tokens == alone.tokens
        assert np.array_equal(out.logits, alone.logits)  # bit for bit, whatever the batch


def test_save_load_round_trip_gives_identical_logits(model, tmp_path):
    path = tmp_path / "tiny.h5"
    save_weights(model.cfg, model.state_dict(), path)
    loaded = load_model(path)
    assert dataclasses.replace(loaded.cfg, weights="random") == model.cfg
    before = _generate(model, max_new_tokens=6, mtp_depth=1, record_logits=True)
    after = _generate(loaded, max_new_tokens=6, mtp_depth=1, record_logits=True)
    for a, b in zip(before, after):
        assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
    wrong = dataclasses.replace(model.cfg, weights=str(path), hidden=64)
    with pytest.raises(ConfigError, match=r"model.hidden: checkpoint 128 vs config 64"):
        build_model(wrong)


def test_float32_and_int8_stay_close_to_float64(model):
    ref = _generate(model, max_new_tokens=1, record_logits=True)
    f32 = _generate(build_model(model.cfg, dtype=np.float32), max_new_tokens=1, record_logits=True)
    int8 = _generate(model, max_new_tokens=1, use_int8=True, record_logits=True)
    for r, a, q in zip(ref, f32, int8):
        np.testing.assert_allclose(a.logits.astype(np.float64), r.logits, rtol=0, atol=1e-4)
        assert not np.array_equal(q.logits, r.logits)  # the INT8 trip really happened
        np.testing.assert_allclose(q.logits, r.logits, rtol=0, atol=0.2)


def test_sampling_is_seeded_and_mtp_sampling_runs(model):
    a = _generate(model, temperature=0.8, seed=5, mtp_depth=1)
    b = _generate(model, temperature=0.8, seed=5, mtp_depth=1)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.tokens for o in a] != [o.tokens for o in _generate(model, temperature=0.8, seed=6)]


@pytest.mark.parametrize("draft", [0, 2])
def test_speculative_sampling_matches_the_main_model_distribution(draft):
    """First token after a draft: accepted with p(draft), else resampled without it; overall it
    must be distributed as softmax(logits / T)."""
    logits = np.array([[1.0, 0.2, -0.5, 0.7, 0.0], [0.0] * 5])
    gen = np.random.default_rng(0)
    num_draws = 8000
    counts = np.zeros(5)
    for _ in range(num_draws):
        counts[verify_drafts(logits.copy(), [draft], temperature=0.7, generator=gen)[0]] += 1
    expected = np.exp(logits[0] / 0.7) / np.exp(logits[0] / 0.7).sum()
    # 0.02 is about 4 standard deviations of a frequency over 8000 draws.
    np.testing.assert_allclose(counts / num_draws, expected, rtol=0, atol=0.02)
