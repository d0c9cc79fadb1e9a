"""Training: a few steps on a slice of the stdlib lower the loss and repeat bit for bit from the
seed; the full-sequence training forward gives the logits of the latent-cache inference path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.shapes import compute_shape
from xds_mpi.model.weights import build_model
from xds_mpi.train.corpus import is_heldout, load_corpus, spread_windows, stdlib_files
from xds_mpi.train.forward import sequence_logits
from xds_mpi.train.options import TrainConfig
from xds_mpi.train.trainer import train_tiny

torch.set_num_threads(1)
NUM_FILES = 40  # the first 40 sorted stdlib files hold one held-out file
TINY_RUN = TrainConfig(
    steps=8, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, num_eval_windows=4
)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_files=NUM_FILES)


def test_the_split_is_by_file_and_fixed():
    files = stdlib_files()
    assert files == sorted(files) and "os.py" in files
    assert not any(part in ("test", "site-packages") for f in files for part in f.split("/")[:-1])
    heldout = [f for f in files if is_heldout(f)]
    assert 0.05 < len(heldout) / len(files) < 0.2


def _run(corpus, tc: TrainConfig):
    losses: list[float] = []
    result = train_tiny(ModelConfig(), corpus, tc, progress=lambda r: losses.append(r.loss))
    return result, losses


def test_a_few_steps_lower_the_loss_and_repeat_bit_for_bit(corpus):
    first, losses = _run(corpus, TINY_RUN)
    again, losses_again = _run(corpus, TINY_RUN)
    assert len(losses) == TINY_RUN.steps
    assert losses[-1] < losses[0] - 0.3, losses
    assert losses == losses_again and first.heldout_loss == again.heldout_loss
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), again.model.state_dict().items()
    ):
        assert torch.equal(a, b), name
    other, _ = _run(corpus, dataclasses.replace(TINY_RUN, seed=1))
    assert not torch.equal(other.model.head.weight, first.model.head.weight)
    # The frozen selection bias never moves: balancing is left off on purpose.
    assert all(not layer.ffn.gate.bias.any() for layer in first.model.layers if layer.is_moe)


def _prefill(model, tokens: torch.Tensor):
    """The inference path: one chunk through the latent cache -> (h^0 [t, hidden], cache)."""
    num_tokens = len(tokens)
    cache = LatentCache(
        num_layers=model.num_cache_layers(len(model.mtp)),
        num_slots=num_tokens,
        kv_lora_rank=model.cfg.kv_lora_rank,
        rope_dim=model.cfg.qk_rope_dim,
        dtype=model.dtype,
    )
    chunk = AttnChunk(start_pos=0, num_tokens=num_tokens, slots=torch.arange(num_tokens))
    return model(tokens, torch.arange(num_tokens), [chunk], cache), cache


@pytest.mark.parametrize("weights", ["random", "tiny"])
def test_training_forward_equals_the_latent_cache_path(corpus, weights):
    model = build_model(
        dataclasses.replace(compute_shape(), weights=weights, num_mtp_modules=2)
        if weights == "random"
        else compute_shape()
    )
    tokens = spread_windows(corpus.heldout, num_windows=1, window_len=48)[0]
    trained = sequence_logits(model, tokens[None])
    with torch.no_grad():
        hidden, cache = _prefill(model, tokens)
        torch.testing.assert_close(trained.main[0], model.logits(hidden), rtol=0, atol=1e-9)
        prev = hidden
        for depth, mtp_logits in enumerate(trained.mtp, start=1):
            num_rows = len(tokens) - depth
            chunk = AttnChunk(start_pos=0, num_tokens=num_rows, slots=torch.arange(num_rows))
            prev = model.mtp_forward(
                depth, prev[:num_rows], tokens[depth:], torch.arange(num_rows), [chunk], cache
            )
            torch.testing.assert_close(
                mtp_logits[0], model.mtp_logits(depth, prev), rtol=0, atol=1e-9
            )
    assert len(trained.mtp) == model.cfg.num_mtp_modules


def test_training_forward_gives_the_logits_greedy_decoding_chose_from(corpus):
    model = build_model(compute_shape())
    prompt = spread_windows(corpus.heldout, num_windows=1, window_len=20)[0].tolist()
    [out] = ReferenceGenerator(
        model,
        GenerateOptions(
            max_new_tokens=12, mtp_depth=1, ignore_eos=True, block_tokens=4, record_logits=True
        ),
    ).generate([prompt])
    full = torch.tensor([*prompt, *out.tokens[:-1]])
    with torch.no_grad():
        trained = sequence_logits(model, full[None]).main[0, len(prompt) - 1 :]
    torch.testing.assert_close(trained, out.logits, rtol=0, atol=1e-9)
