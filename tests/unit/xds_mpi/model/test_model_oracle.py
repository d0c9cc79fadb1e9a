"""The served numpy model (xds_mpi/model/) against its torch twin (xds_mpi/train/torch_model.py),
an independent implementation: whole sequences, MLA un-absorbed, torch's own kernels.

Tolerance: logits agree to 1e-9 absolute (measured: ~2e-14 on the checkpoint, float64); greedy
tokens and MTP drafts are equal over 300 generated tokens per prompt, on the trained checkpoint
and on random weights (the same seeded arrays in both models).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.shapes import compute_shape
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.model.transformer import param_shapes
from xds_mpi.model.weights import build_model, weights_path

torch = pytest.importorskip("torch", reason="torch is the train extra: pip install -e '.[train]'")

from xds_mpi.train.forward import sequence_logits  # noqa: E402
from xds_mpi.train.torch_model import load_torch_model, random_torch_model  # noqa: E402

torch.set_num_threads(1)
MAX_LOGIT_DIFF = 1e-9
NUM_TOKENS = 300
PROMPTS = ["def __init__(self, path):\n    ", "import numpy as np\n", "The quick brown fox"]


@pytest.fixture(scope="module", params=["tiny", "random"])
def models(request):
    """(numpy model, torch twin) holding the same weights."""
    if request.param == "tiny":
        return build_model(compute_shape()), load_torch_model(weights_path("tiny"))
    cfg = dataclasses.replace(compute_shape(), weights="random", seed=3, num_mtp_modules=2)
    return build_model(cfg), random_torch_model(cfg, 3)


def test_both_models_name_and_shape_every_tensor_alike(models):
    served, twin = models
    shapes = {name: tuple(t.shape) for name, t in twin.state_dict().items()}
    assert shapes == param_shapes(served.cfg)
    for name, value in served.state_dict().items():
        assert np.array_equal(value, twin.state_dict()[name].numpy()), name


def _decode(served, prompt: list[int]):
    options = GenerateOptions(
        max_new_tokens=NUM_TOKENS, mtp_depth=1, ignore_eos=True, record_logits=True
    )
    return ReferenceGenerator(served, options).generate([prompt])[0]


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_tokens_logits_and_mtp_drafts_match_the_torch_twin(models, text):
    served, twin = models
    prompt = ByteTokenizer().encode(text)
    out = _decode(served, prompt)
    full = torch.tensor([[*prompt, *out.tokens[:-1]]])
    with torch.no_grad():
        oracle = sequence_logits(twin, full, mtp_depth=1)
    main = oracle.main[0, len(prompt) - 1 :].numpy()  # row i chose generated token i
    assert np.abs(main - out.logits).max() < MAX_LOGIT_DIFF
    assert main.argmax(-1).tolist() == list(out.tokens)
    # The drafts verified at decode step j: module 1 at position c - 2, c tokens committed then.
    mtp = oracle.mtp[0][0].numpy().argmax(-1)
    num_committed = len(prompt) + 1
    for drafts, accepted in zip(out.step_drafts, out.step_accepted):
        assert list(drafts) == [int(mtp[num_committed - 2])]
        num_committed += accepted + 1
    assert len(out.step_drafts) == out.num_steps > NUM_TOKENS // 2
