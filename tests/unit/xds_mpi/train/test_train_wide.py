"""A checkpoint with ep288's routing (256 routed experts, top-8, 8 groups, 4 kept), made by
`xds-mpi train-tiny` in a few steps: the numpy model serves it as its torch twin computes it, and
`xds-mpi run ep288` at five dies loads it, says so, and matches the single-process reference.

Tolerance as tests/unit/xds_mpi/model/test_model_oracle.py: logits to 1e-9 absolute in float64.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import REPO_ROOT

from launch.model.train import describe_weights
from xds_mpi.model.checkpoint import read_checkpoint_config
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.model.weights import build_model

torch = pytest.importorskip("torch", reason="torch is the train extra: pip install -e '.[train]'")

from xds_mpi.train.forward import sequence_logits  # noqa: E402
from xds_mpi.train.torch_model import load_torch_model  # noqa: E402

torch.set_num_threads(1)
XDS_MPI = Path(sys.executable).parent / "xds-mpi"
EP288_ROUTING = ["--experts", "256", "--top-k", "8", "--expert-groups", "8", "--topk-groups", "4"]
MAX_LOGIT_DIFF = 1e-9
# ep288 at five dies: four hold 64 routed experts and one redundant slot each, one the shared one.
FIVE_DIES = [
    "deployment.dp_groups_per_domain=5",
    "deployment.num_shared_expert_dies=1",
    "workload.num_requests=5",
    "run.timeout_s=300",
]


def _xds_mpi(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, timeout=400, cwd=cwd
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "ep288.h5"
    result = _xds_mpi(
        "train-tiny", *EP288_ROUTING, "--steps", "2", "--batch-size", "2", "--seq-len", "16",
        "--max-files", "40", "--out", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"wrote {path}" in result.stdout
    return path


def test_the_checkpoint_has_ep288s_routing_and_says_how_it_was_trained(checkpoint):
    cfg = read_checkpoint_config(checkpoint)
    routing = (cfg.num_routed_experts, cfg.top_k, cfg.num_expert_groups, cfg.topk_groups)
    assert routing == (256, 8, 8, 4)
    assert describe_weights(cfg).startswith(
        f"weights: {checkpoint}, trained 2 steps x 2 x 16 tokens on 40 files (seed 0), "
        "held-out loss "
    )
    random = describe_weights(dataclasses.replace(cfg, weights="random", seed=5))
    assert random.startswith("weights: random (seed 5), untrained")


def test_the_served_model_computes_what_the_torch_twin_trained(checkpoint):
    served, twin = build_model(read_checkpoint_config(checkpoint)), load_torch_model(checkpoint)
    prompt = ByteTokenizer().encode("def __init__(self, path):\n    ")
    options = GenerateOptions(max_new_tokens=24, ignore_eos=True, record_logits=True)
    out = ReferenceGenerator(served, options).generate([prompt])[0]
    with torch.no_grad():
        oracle = sequence_logits(twin, torch.tensor([[*prompt, *out.tokens[:-1]]]), mtp_depth=0)
    main = oracle.main[0, len(prompt) - 1 :].numpy()  # row i chose generated token i
    assert np.abs(main - out.logits).max() < MAX_LOGIT_DIFF
    assert main.argmax(-1).tolist() == list(out.tokens)


def test_ep288_at_five_dies_serves_the_checkpoint_and_matches_the_reference(checkpoint, tmp_path):
    sets = [f"model.weights={checkpoint}", f"run.output_dir={tmp_path}", *FIVE_DIES]
    result = _xds_mpi("run", "ep288", "--check", *(a for s in sets for a in ("--set", s)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"xds-mpi: weights: {checkpoint}, trained 2 steps" in result.stdout
    assert "check: 5 requests, " in result.stdout and " 0 mismatches" in result.stdout
