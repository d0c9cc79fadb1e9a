"""Training: a few steps on a slice of the stdlib lower the loss and repeat bit for bit from the
seed (the training forward against the served numpy model:
tests/unit/xds_mpi/model/test_model_oracle.py)."""

from __future__ import annotations

import dataclasses

import pytest

from xds_mpi.config.schema import ModelConfig

torch = pytest.importorskip("torch", reason="torch is the train extra: pip install -e '.[train]'")

from xds_mpi.train.corpus import is_heldout, load_corpus, stdlib_files  # noqa: E402
from xds_mpi.train.options import TrainConfig  # noqa: E402
from xds_mpi.train.trainer import train_tiny  # noqa: E402

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
