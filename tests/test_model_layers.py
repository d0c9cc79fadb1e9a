"""The batch-invariant matmul (xds_mpi/model/layers.py): a row's result does not depend on how
many rows it is computed with, so a request's tokens do not depend on its batch."""

from __future__ import annotations

import numpy as np

from xds_mpi.model.layers import ROW_BLOCK, matmul


def test_a_rows_result_does_not_depend_on_the_row_count():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((130, 128))  # [rows, in]
    w = rng.standard_normal((128, 96))  # [in, out]
    full = matmul(x, w)
    for num_rows in range(1, 131):
        part = matmul(x[:num_rows], w)
        assert part.shape == (num_rows, 96)
        assert np.array_equal(part, full[:num_rows]), f"{num_rows} rows"


def test_the_result_is_the_plain_product_within_rounding():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((7, 64)), rng.standard_normal((64, 32))
    assert ROW_BLOCK >= 1
    np.testing.assert_allclose(matmul(x, w), x @ w, rtol=1e-12, atol=1e-12)


def test_the_padding_rows_are_zero_whatever_an_earlier_call_left():
    """matmul reuses its padded buffer: rows a call with more rows wrote must not reach the
    next product (here 1e200 x 1e200 would overflow, which numpy reports)."""
    width = 8
    huge = np.full((3, width), 1e200)
    matmul(huge, np.full((width, 2), 1e-300))  # three rows written into the 4-row buffer
    w = np.full((width, 2), 1e200)
    with np.errstate(over="raise", invalid="raise"):
        out = matmul(np.ones((1, width)), w)  # one row: the buffer's rows 1-3 are padding
    zero_padded = np.vstack([np.ones((1, width)), np.zeros((3, width))])
    assert np.array_equal(out, np.dot(zero_padded, w)[:1])
