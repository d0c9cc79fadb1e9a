"""The batch-invariant matmul (xds_mpi/model/layers.py): a row's result does not depend on how
many rows it is computed with, so a request's tokens do not depend on its batch.
tests/unit/xds_mpi/model/test_blas_kernels.py runs this file again under every BLAS kernel family
the CPU can run."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model import layers, mla, moe
from xds_mpi.model.layers import ROWS_PER_CALL, matmul
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.model.weights import build_model

MAX_ROWS = 130


def _rows_differing(x: np.ndarray, w: np.ndarray) -> list[int]:
    """Row counts n in 1..len(x) at which matmul(x[:n], w) differs in any bit from each row
    computed alone (so a row's place in the batch and the batch's size both count)."""
    alone = np.vstack([matmul(x[i : i + 1], w) for i in range(len(x))])
    return [n for n in range(1, len(x) + 1) if not np.array_equal(matmul(x[:n], w), alone[:n])]


def test_a_rows_result_does_not_depend_on_the_row_count():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((MAX_ROWS, 128))  # [rows, in]
    w = rng.standard_normal((128, 96))  # [in, out]
    full = matmul(x, w)
    for num_rows in range(1, MAX_ROWS + 1):
        part = matmul(x[:num_rows], w)
        assert part.shape == (num_rows, 96)
        assert np.array_equal(part, full[:num_rows]), f"{num_rows} rows"


@pytest.fixture(scope="module")
def model_operands():
    """Every distinct right-hand operand (shape, strides, dtype) the model's matmul sees in a
    batched generation with MTP: each projection, the gate, the experts, MLA's absorbed and
    per-head weights, the attention against the cache, the LM head, the MTP modules."""
    seen: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def recording(x, w):
        seen.setdefault((w.shape, w.strides, w.dtype.str, x.dtype.str), (x[:1].copy(), w))
        return matmul(x, w)

    model = build_model(ModelConfig(num_mtp_modules=2))
    prompts = [ByteTokenizer().encode(t) for t in ["The quick brown fox", "abc", "MoE"]]
    patch = pytest.MonkeyPatch()
    for module in (layers, mla, moe):
        patch.setattr(module, "matmul", recording)
    try:
        opts = GenerateOptions(max_new_tokens=3, ignore_eos=True, mtp_depth=2, block_tokens=4)
        ReferenceGenerator(model, opts).generate(prompts)
    finally:
        patch.undo()
    return list(seen.values())


def test_every_operand_the_model_multiplies_is_batch_invariant(model_operands):
    assert len(model_operands) >= 10  # the hook saw the model's products
    rng = np.random.default_rng(2)
    for sample, w in model_operands:
        x = rng.standard_normal((MAX_ROWS, w.shape[0])).astype(sample.dtype)
        assert _rows_differing(x, w) == [], f"operand {w.shape} strides {w.strides}"


def test_the_check_fails_for_a_product_of_the_rows_own_count():
    """The measure above can fail: a plain product of n rows, on a kernel whose path moves with
    the row count (OpenBLAS's AVX-512 kernels at 512 x 128), differs at most row counts. On the
    AVX2 kernels it does not, so the check only runs where the old construction breaks."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((MAX_ROWS, 512)), rng.standard_normal((512, 128))
    plain = [
        n
        for n in range(1, MAX_ROWS + 1)
        if not np.array_equal(np.dot(x[:n], w)[-1], np.dot(x[n - 1 : n], w)[0])
    ]
    if not plain:
        pytest.skip("this BLAS kernel gives plain products the same rows at every count")
    assert _rows_differing(x, w) == []


def test_the_result_is_the_plain_product_within_rounding():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((7, 64)), rng.standard_normal((64, 32))
    np.testing.assert_allclose(matmul(x, w), x @ w, rtol=1e-12, atol=1e-12)
    assert matmul(x[:0], w).shape == (0, 32)
    strided = rng.standard_normal((9, 3, 64))[:, 1]  # rows of a wider array: not contiguous
    assert np.array_equal(matmul(strided, w), matmul(strided.copy(), w))


def test_the_padding_rows_are_zero_whatever_an_earlier_call_left():
    """matmul reuses its padded buffer: rows a call with more rows wrote must not reach the
    next product (here 1e200 x 1e200 would overflow, which numpy reports)."""
    width = 8
    huge = np.full((ROWS_PER_CALL - 1, width), 1e200)
    matmul(huge, np.full((width, 2), 1e-300))  # rows written into the padded buffer
    w = np.full((width, 2), 1e200)
    with np.errstate(over="raise", invalid="raise"):
        out = matmul(np.ones((1, width)), w)  # one row: the buffer's other rows are padding
    zero_padded = np.vstack([np.ones((1, width)), np.zeros((ROWS_PER_CALL - 1, width))])
    assert np.array_equal(out, np.dot(zero_padded, w)[:1])
