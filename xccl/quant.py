"""INT8 per-token quantization, fused into dispatch (xDeepServe §3.2 step 2, §4.7).

Each row (token) gets one scale = max|x| / 127, stored as float32; q = round(x / scale) in
[-127, 127]. Dequantized values differ from x by at most scale / 2 per element (plus the float
rounding of the division). The model's single-process reference calls these same functions at the
point where the distributed path quantizes, so INT8 runs compare token for token.
"""
from __future__ import annotations

import numpy as np

QMAX = 127


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: [rows, hidden] float -> (q: [rows, hidden] int8, scale: [rows] float32)."""
    absmax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0])
    scale = np.where(absmax > 0, absmax / QMAX, 1.0).astype(np.float32)
    q = np.rint(x / scale[:, None].astype(x.dtype))
    return np.clip(q, -QMAX, QMAX).astype(np.int8), scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray, dtype=np.float64) -> np.ndarray:
    """(q: [rows, hidden] int8, scale: [rows] float32) -> [rows, hidden] `dtype`."""
    return q.astype(dtype) * scale.astype(dtype)[:, None]


def quant_dequant(x: np.ndarray) -> np.ndarray:
    """What a row looks like after an INT8 trip through dispatch."""
    q, scale = quantize_int8(x)
    return dequantize_int8(q, scale, x.dtype)
