"""SmoothQuant's smoothing factors (Xiao et al. 2023, eq. 4): move range from activations to
weights before INT8 quantization.

For a projection y = x W^T (W: [out, in]) and calibration activations X: [rows, in], input
channel j gets s_j = max|X_j|^alpha / max|W_{:, j}|^(1 - alpha). Then (X diag(1/s)) (W diag(s))^T
= X W^T exactly, and with alpha = 1/2 both smoothed ranges become sqrt(max|X_j| max|W_j|).
"""

from __future__ import annotations

import numpy as np

MIN_FACTOR = 1e-5  # SmoothQuant clamps the ranges so that no factor is 0 or infinite


def smoothing_factors(act_absmax: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """act_absmax: [in] max |x_j| over the calibration rows, weight: [out, in] -> s: [in]
    float32 (an input channel no calibration row reached keeps s = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothing alpha must lie in [0, 1], got {alpha}")
    act = np.maximum(act_absmax.astype(np.float64), MIN_FACTOR)
    wmax = np.maximum(np.abs(weight).max(axis=0).astype(np.float64), MIN_FACTOR)
    s = act**alpha / wmax ** (1.0 - alpha)
    return np.where(act_absmax > 0, s, 1.0).astype(np.float32)


def smooth(
    weight: np.ndarray, hessian: np.ndarray, act_absmax: np.ndarray, s: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The projection's statistics in the smoothed space x' = x / s:
    (W diag(s) [out, in], diag(1/s) H diag(1/s) [in, in], max|x'_j| [in])."""
    s = s.astype(np.float64)
    return weight * s[None, :], hessian / np.outer(s, s), act_absmax / s
