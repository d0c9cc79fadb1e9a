"""Building blocks shared by attention, MoE and MTP: the batch-invariant matmul, RMSNorm, rotary
embedding, SwiGLU FFN. numpy only: a die imports no torch (tests/e2e/cli/test_no_torch.py).

Batch invariance: a request's tokens must not depend on what it is batched with. A BLAS
library picks its kernel, tiling and small-matrix path from a product's shape (OpenBLAS's AVX-512
kernels switch paths with M x N x K, its AVX2 kernels treat a row remainder apart), so the same
row can come out with other last bits when the row count changes. `matmul` therefore never
hands BLAS a row count of its own: it pads the rows to a multiple of ROWS_PER_CALL and makes
one gemm call per ROWS_PER_CALL rows (numpy's stacked matmul loops over the stack, one gemm
each), so every call has the same shape, layout and dtype and takes the same path on any BLAS.
What that construction leaves open is whether a row's place inside its call matters; it does not
on any OpenBLAS kernel family measured (tests/unit/xds_mpi/model/test_blas_kernels.py runs the
invariance and the reference tests under every family the CPU can run: Haswell, Zen, SkylakeX,
Cooperlake, SapphireRapids). docs/design.md, "Batch invariance", has the numbers.

Speed at a decode step's few rows is numpy's per-call overhead, so the reductions call the ufuncs
(`np.add.reduce`, `np.maximum.reduce`) that `mean`, `sum` and `max` wrap in Python: the same
results, a few microseconds less a call.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.model import blas
from xds_mpi.model.qlinear import SCALE_SUFFIX, QuantLinear, base_name

blas.single_thread()  # one BLAS thread: see xds_mpi/model/blas.py
NORM_EPS = 1e-6
ROWS_PER_CALL = 4  # every gemm call's row count (a decode step's rows per die fit one call)


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x: [n, k] @ w: [k, m] -> [n, m], each row's value independent of n.

    The rows, padded with zero rows to a multiple of ROWS_PER_CALL, go to BLAS as a stack of
    [ROWS_PER_CALL, k] matrices: one call of one shape per stack entry, whatever n is. A decode
    step's few rows are one such matrix, which `np.dot` hands to the same gemm call with less
    dispatch around it (docs/design.md, invariant 5)."""
    num_rows, width = x.shape
    pad = -num_rows % ROWS_PER_CALL
    if pad:
        padded = _padded(num_rows, num_rows + pad, width, x.dtype)
        padded[:num_rows] = x
        x = padded
    else:
        x = np.ascontiguousarray(x)  # a strided view would leave BLAS for numpy's own loop
    if num_rows <= ROWS_PER_CALL:
        return np.dot(x, w)[:num_rows]
    out = np.matmul(x.reshape(-1, ROWS_PER_CALL, width), w)
    return out.reshape(-1, w.shape[1])[:num_rows]


# Padded inputs of the few rows a decode step has, one zeroed buffer per shape, reused: a fresh
# np.zeros per call cost a calloc and its memset, 60 calls a forward. Each buffer remembers how
# many rows were last written, so the padding rows are zero again before a call with fewer
# (zeros as before: no row of an earlier call reaches dgemm, whose overflow numpy reports).
_PADDED: dict[tuple, list] = {}  # (rows, width, dtype) -> [buffer, rows written last]
MAX_PADDED_ROWS = 64  # more rows (a prefill's): a buffer of their own each time


def _padded(num_rows: int, padded_rows: int, width: int, dtype: np.dtype) -> np.ndarray:
    """A zeroed [padded_rows, width] buffer whose first num_rows rows the caller fills."""
    if padded_rows > MAX_PADDED_ROWS:
        return np.zeros((padded_rows, width), dtype)
    key = (padded_rows, width, dtype)
    entry = _PADDED.get(key)
    if entry is None:
        entry = _PADDED[key] = [np.zeros((padded_rows, width), dtype), num_rows]
    elif entry[1] > num_rows:
        entry[0][num_rows : entry[1]] = 0
    entry[1] = num_rows
    return entry[0]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    """Along the last axis; -inf entries get probability 0."""
    e = np.exp(x - np.maximum.reduce(x, axis=-1, keepdims=True))
    return e / np.add.reduce(e, axis=-1, keepdims=True)


class Linear:
    """y = x W^T without bias. Only W^T [in, out] is held (contiguous, as the matmul wants it);
    `weight` [out, in] is its view, as the checkpoint stores it."""

    def __init__(self, weight: np.ndarray) -> None:
        self.wt = np.ascontiguousarray(weight.T)

    @classmethod
    def of(cls, params: dict[str, np.ndarray], name: str) -> Linear:
        """The projection params[name]; the dict then holds its view (one copy in memory)."""
        linear = cls(params[name])
        params[name] = linear.weight
        return linear

    @property
    def weight(self) -> np.ndarray:
        return self.wt.T

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: [rows, in] -> [rows, out]"""
        return matmul(x, self.wt)

    def poison(self) -> None:
        """An emulated memory fault: every output becomes NaN."""
        self.wt.fill(np.nan)


def projection(params, name: str) -> Linear | QuantLinear:
    """params[name] as an INT8 projection when the checkpoint quantized it (its scales are
    there, xds_mpi/model/qlinear.py), else a float one."""
    if base_name(name) + SCALE_SUFFIX in params:
        return QuantLinear.of(params, name)
    return Linear.of(params, name)


class RMSNorm:
    def __init__(self, weight: np.ndarray, *, eps: float = NORM_EPS) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: [..., dim] -> [..., dim]"""
        mean_square = np.add.reduce(x * x, axis=-1, keepdims=True) / x.shape[-1]  # `mean`'s sum
        return x / np.sqrt(mean_square + self.eps) * self.weight


class SwiGLU:
    """w2(silu(w1 x) * w3 x): the dense FFN, one routed expert and the shared expert(s)."""

    def __init__(self, params: dict[str, np.ndarray], prefix: str) -> None:
        self.w1 = projection(params, f"{prefix}w1.weight")
        self.w3 = projection(params, f"{prefix}w3.weight")
        self.w2 = projection(params, f"{prefix}w2.weight")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: [rows, hidden] -> [rows, hidden]"""
        return self.w2(silu(self.w1(x)) * self.w3(x))

    def broken(self) -> SwiGLU:
        """A copy whose weights are NaN (an emulated memory fault on the slot holding it)."""
        copy = object.__new__(SwiGLU)
        for name in ("w1", "w3", "w2"):
            setattr(copy, name, Linear(np.full_like(getattr(self, name).weight, np.nan)))
        return copy

    def break_in_place(self) -> None:
        for linear in (self.w1, self.w3, self.w2):
            linear.poison()


class Rotary:
    """Rotary position embedding on the last dim (rotate-half layout) from a precomputed table.

    DeepSeek-V3 extends its context with YaRN; the tiny model's max_seq_len is short enough that
    plain RoPE (theta = rope_theta) is used.

    x rotated is [x1 cos - x2 sin, x1 sin + x2 cos] (x1, x2 the halves), computed as
    x [cos, cos] + [x2, x1] [-sin, sin]: the same products and sums bit for bit (a - b is
    a + (-b) in IEEE arithmetic, and a sum does not depend on its order of two terms), in four
    numpy calls instead of eleven.
    """

    def __init__(self, *, dim: int, max_seq_len: int, theta: float, dtype: np.dtype) -> None:
        if dim % 2:
            raise ValueError(f"RoPE needs an even dimension, got qk_rope_dim={dim}")
        inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.outer(np.arange(max_seq_len, dtype=np.float64), inv_freq)
        self.max_seq_len, self.half = max_seq_len, dim // 2
        cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)  # [len, dim / 2]
        self.cos = np.concatenate([cos, cos], axis=1)  # [max_seq_len, dim]
        self.sin = np.concatenate([-sin, sin], axis=1)  # signed: x2's half is subtracted
        # The last positions array's (cos, sin) rows, by the rank of x: every layer's queries and
        # keys of one forward rotate by the same positions, so the rows are gathered once.
        self._last: tuple[np.ndarray, dict] | None = None

    def _rows(self, positions: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
        """positions: [rows] int64 -> (cos, sin) [rows, 1 ..., dim] for an x of `ndim` dims"""
        if self._last is None or self._last[0] is not positions:
            if positions.size and int(positions.max()) >= self.max_seq_len:
                raise ValueError(
                    f"position {int(positions.max())} is beyond model.max_seq_len"
                    f"({self.max_seq_len})"
                )
            self._last = (positions, {})
        by_ndim = self._last[1]
        rows = by_ndim.get(ndim)
        if rows is None:
            shape = (len(positions),) + (1,) * (ndim - 2) + (self.cos.shape[1],)  # 0 rows too
            rows = by_ndim[ndim] = (
                self.cos[positions].reshape(shape),
                self.sin[positions].reshape(shape),
            )
        return rows

    def __call__(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: [rows, ..., dim], positions: [rows] int64 -> x rotated by each row's position."""
        cos, sin = self._rows(positions, x.ndim)
        half = self.half
        swapped = np.concatenate([x[..., half:], x[..., :half]], axis=-1)
        return x * cos + swapped * sin
