"""The packaged checkpoint (xds_mpi/data/tiny.h5, `model.weights: tiny`): the default configs load
it, it has learned the held-out stdlib code, its router is skewed and its MTP module's drafts
are mostly accepted; `xds-mpi generate` and `xds-mpi stats` run on it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import REPO_ROOT

from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import load_config
from xds_mpi.model.shapes import compute_shape
from xds_mpi.model.weights import build_model, weights_path

torch = pytest.importorskip("torch", reason="torch is the train extra: pip install -e '.[train]'")

from xds_mpi.train.corpus import load_corpus, spread_windows  # noqa: E402
from xds_mpi.train.stats import text_stats  # noqa: E402
from xds_mpi.train.torch_model import load_torch_model  # noqa: E402

torch.set_num_threads(1)
XDS_MPI = Path(sys.executable).parent / "xds-mpi"
# Measured on the committed checkpoint over these 8 held-out windows of 128 tokens: loss 1.562,
# hottest/mean 5.27, 6.95, 7.51 (layers 1-3) and 5.62 (MTP block), MTP module 1 teacher-forced
# acceptance 77.3 %. Random weights on as many tokens: loss ~5.6, hottest/mean ~2-2.7,
# acceptance ~1 %. The bounds leave room for another Python's stdlib.
MAX_HELDOUT_LOSS = 2.5  # ln(256) = 5.55
MIN_HOTTEST_OVER_MEAN = 3.0
MIN_MTP_ACCEPTANCE = 0.50  # the target for module 1


@pytest.fixture(scope="module")
def model():
    return load_torch_model(weights_path("tiny"))


@pytest.fixture(scope="module")
def stats(model):
    windows = spread_windows(load_corpus().heldout, num_windows=8, window_len=129)
    return text_stats(model, windows)


def test_the_default_configs_use_the_packaged_checkpoint(model):
    cfg = load_config(resolve_config("colocated"))
    assert cfg.model.weights == "tiny" and weights_path("tiny").is_file()
    assert dataclasses.replace(model.cfg, weights="tiny") == cfg.model == compute_shape()
    served = build_model(cfg.model)
    assert np.array_equal(served.head.weight, model.head.weight.numpy())
    random = build_model(dataclasses.replace(cfg.model, weights="random"))
    assert not np.array_equal(random.head.weight, served.head.weight)


def test_the_checkpoint_has_learned_held_out_code(stats):
    assert stats.loss < MAX_HELDOUT_LOSS


def test_its_router_is_skewed_and_its_mtp_drafts_are_accepted(stats):
    assert max(load.max_over_mean for load in stats.expert_loads) > MIN_HOTTEST_OVER_MEAN
    assert stats.mtp_acceptance[0] > MIN_MTP_ACCEPTANCE


def _xds_mpi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )


def test_generate_prints_python_like_text():
    result = _xds_mpi("generate", "--prompt", "def ", "--max-new-tokens", "40", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    text = result.stdout.rstrip("\n").rsplit("\n", 1)[0]
    assert len(text) >= 20
    printable = sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text)
    assert printable / len(text) > 0.95, text


def test_stats_reports_load_acceptance_and_perplexity():
    result = _xds_mpi("stats", "--windows", "2", "--prompts", "1")
    assert result.returncode == 0, result.stderr
    assert "perplexity" in result.stdout and "layer 1: hottest/mean" in result.stdout
    assert "MTP module 1 acceptance, teacher-forced" in result.stdout
    assert "MTP depth 1, greedy decoding of 1 prompts" in result.stdout
