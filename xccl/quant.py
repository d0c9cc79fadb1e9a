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
    # The ufuncs themselves: `max` and `clip` add Python wrappers that cost more than the work
    # at a decode step's few rows (the results are the same, NaN included).
    absmax = np.maximum.reduce(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0])
    scale = np.where(absmax > 0, absmax / QMAX, 1.0).astype(np.float32)
    q = np.rint(x / scale[:, None].astype(x.dtype))
    np.minimum(np.maximum(q, -QMAX, out=q), QMAX, out=q)
    return q.astype(np.int8), scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray, dtype=np.float64) -> np.ndarray:
    """(q: [rows, hidden] int8, scale: [rows] float32) -> [rows, hidden] `dtype`."""
    return q.astype(dtype) * scale.astype(dtype)[:, None]


def encode_rows(
    staged: np.ndarray, x: np.ndarray, token: np.ndarray, *, hidden: int, use_int8: bool, dtype
) -> None:
    """Write rows x[token] into staged wire rows [len(token), row_bytes] uint8 (in place, e.g. a
    window): INT8 values + a float32 scale, or the values as `dtype`; padding left as it is."""
    if use_int8:
        q, scale = quantize_int8(x[token])
        staged[:, :hidden] = q.view(np.uint8)
        staged[:, hidden : hidden + 4] = scale.view(np.uint8).reshape(-1, 4)
        return
    width = hidden * np.dtype(dtype).itemsize
    if staged.shape[1] == width:  # copy straight in
        np.take(x.astype(dtype, copy=False), token, axis=0, out=staged.view(dtype))
    else:
        staged[:, :width] = x[token].astype(dtype).view(np.uint8)


def send_row_bytes(hidden: int, itemsize: int, use_int8: bool) -> int:
    """A staged token row: hidden x itemsize, or INT8 values + a float32 scale; 8-byte aligned."""
    raw = hidden + 4 if use_int8 else hidden * itemsize
    return (raw + 7) // 8 * 8


def decode_rows(raw: np.ndarray, *, hidden: int, use_int8: bool, dtype) -> np.ndarray:
    """Staged wire rows [rows, row_bytes] uint8 (send_row_bytes: INT8 values + a
    float32 scale, or the values, padded to 8 bytes) -> [rows, hidden] `dtype`."""
    if use_int8:
        q = raw[:, :hidden].view(np.int8)
        scale = raw[:, hidden : hidden + 4].copy().view(np.float32)[:, 0]
        return dequantize_int8(q, scale, dtype)
    width = hidden * np.dtype(dtype).itemsize
    if raw.shape[1] == width:
        return raw.view(dtype)
    return raw[:, :width].copy().view(dtype)


def quant_dequant(x: np.ndarray) -> np.ndarray:
    """What a row looks like after an INT8 trip through dispatch."""
    q, scale = quantize_int8(x)
    return dequantize_int8(q, scale, x.dtype)
