"""GPTQ (Frantar et al. 2023, Algorithm 1) for per-output-channel INT8 weights.

Round-to-nearest rounds every weight on its own. GPTQ rounds one input column at a time and
spreads that column's rounding error over the columns not yet rounded, weighted by the inverse
Hessian of the layer's output error, H = X^T X / rows over calibration activations X: the
Hessian-guided update xDeepServe §4.7 describes. The per-channel scales are RTN's (max|w| / 127
from the weight before any update), so GPTQ and RTN differ only in which integers they pick.
"""

from __future__ import annotations

import numpy as np

from xccl.quant import QMAX
from xds_mpi.model.qlinear import channel_scales

DAMP_FRACTION = 0.01  # GPTQ's default: H + 1% of its mean diagonal, for a stable inverse


def gptq_quantize(
    weight: np.ndarray, hessian: np.ndarray, *, damp: float = DAMP_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """weight: [out, in], hessian: [in, in] (X^T X / rows) -> (q [out, in] int8, scale [out]
    float32)."""
    w = np.array(weight, np.float64)  # [out, in], updated as columns are rounded
    h = np.array(hessian, np.float64)  # [in, in]
    scale = channel_scales(w).astype(np.float64)  # [out]
    # Step 1: inputs no calibration row reached carry no error: drop their weights.
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    # Step 2: the upper Cholesky factor of the damped inverse Hessian.
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    h_inv = np.linalg.cholesky(np.linalg.inv(h)).T  # [in, in] upper triangular
    q = np.zeros(w.shape, np.int8)
    # Step 3: round column by column, pushing each column's error onto the later ones.
    for col in range(w.shape[1]):
        column = w[:, col]  # [out]
        q_col = np.clip(np.rint(column / scale), -QMAX, QMAX)
        q[:, col] = q_col
        err = (column - q_col * scale) / h_inv[col, col]  # [out]
        w[:, col + 1 :] -= np.outer(err, h_inv[col, col + 1 :])
    return q, scale.astype(np.float32)


def output_error(weight: np.ndarray, approx: np.ndarray, hessian: np.ndarray) -> float:
    """Mean squared output error per row of x W^T vs x approx^T: trace(D H D^T), D = W - approx."""
    diff = np.asarray(weight, np.float64) - np.asarray(approx, np.float64)
    return float(np.einsum("oi,ij,oj->", diff, hessian, diff))
