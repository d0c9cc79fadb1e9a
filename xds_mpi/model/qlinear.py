"""INT8 projections: per-channel INT8 weights, per-token INT8 activations, INT32 accumulation
(xDeepServe §4.7, CloudMatrix-Infer §4.5). numpy only: the dies and the reference run these.

The operator emulated is Ascend's dynamic quant + quant matmul pair:
1. (smoothing) the activation row is divided by the layer's smoothing factors s [in]; SmoothQuant
   multiplied the weight's input columns by the same s when the checkpoint was written;
2. per-token quantization: scale_x = max|x_row| / 127 (float32), q_x = clip(rint(x / scale_x),
   -127, 127): round half to even, symmetric, the same function as XCCL's dispatch rows
   (xccl/quant.py `quantize_int8`);
3. INT8 x INT8 -> INT32: q_x @ q_w^T. The integers are held as float64 and multiplied by BLAS:
   every partial sum is an integer below 127 * 127 * in_features (4.1e6 for 256 inputs, far below
   2^53), so the float64 sums are the exact INT32 results in any order: a row's result does not
   depend on the batch whatever the BLAS kernel does (no row padding needed, unlike layers.matmul);
4. dequantization: acc * scale_x[row] * scale_w[channel] in float64, then the model's dtype.

Weights: one float32 scale per output channel, scale_w = max|w_row| / 127, q_w = clip(rint(w /
scale_w), -127, 127) for round-to-nearest; GPTQ (xds_mpi/quant/gptq.py) picks other integers
with the same scales.
"""

from __future__ import annotations

import numpy as np

from xccl.quant import QMAX, quantize_int8

# A quantized projection `P.weight` [out, in] keeps its integers under that name and adds:
SCALE_SUFFIX = ".weight_scale"  # [out] float32 per-channel weight scale
SMOOTH_SUFFIX = ".smooth_scale"  # [in] float32 smoothing factors (absent: no smoothing)
# The projections xDeepServe §4.7 quantizes: MLA's Wq_a, Wq_b, Wkv_a, Wo and every SwiGLU (dense
# MLP, routed and shared experts). The gate, Wkv_b, eh_proj, the embedding and head stay float.
QUANTIZABLE_ENDINGS = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv_a.weight",
    "attn.wo.weight",
    ".w1.weight",
    ".w3.weight",
    ".w2.weight",
)
# 127 * 127 * in_features must stay below 2^53 for the float64 accumulation to be exact.
MAX_EXACT_IN_FEATURES = (2**53) // (QMAX * QMAX)


def channel_scales(weight: np.ndarray) -> np.ndarray:
    """weight: [out, in] float -> [out] float32: max|w_row| / 127 (1 for an all-zero row)."""
    absmax = np.abs(weight).max(axis=1)
    return np.where(absmax > 0, absmax / QMAX, 1.0).astype(np.float32)


def round_to_grid(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """weight: [out, in], scale: [out] -> [out, in] int8, round half to even, clipped."""
    q = np.rint(weight / scale.astype(np.float64)[:, None])
    return np.clip(q, -QMAX, QMAX).astype(np.int8)


def quantize_rtn(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest: weight [out, in] -> (q [out, in] int8, scale [out] float32)."""
    scale = channel_scales(weight)
    return round_to_grid(weight, scale), scale


def dequantize_weight(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(q [out, in] int8, scale [out]) -> [out, in] float64."""
    return q.astype(np.float64) * scale.astype(np.float64)[:, None]


def is_quantizable(name: str) -> bool:
    return name.endswith(QUANTIZABLE_ENDINGS)


def quant_tensor_shapes(shapes: dict[str, tuple[int, ...]], name: str, *, is_smoothed: bool):
    """The extra tensors of projection `name` [out, in] in an INT8 checkpoint -> their shapes."""
    out_features, in_features = shapes[name]
    extra = {base_name(name) + SCALE_SUFFIX: (out_features,)}
    if is_smoothed:
        extra[base_name(name) + SMOOTH_SUFFIX] = (in_features,)
    return extra


def base_name(weight_name: str) -> str:
    """'layers.1.attn.wq_a.weight' -> 'layers.1.attn.wq_a'"""
    return weight_name.removesuffix(".weight")


class QuantLinear:
    """y = dequant(q(x / s) @ q_w^T): an INT8 projection without bias.

    q_weight: [out, in] integers in [-127, 127] (any dtype holding them exactly);
    weight_scale: [out] per output channel; smooth: [in] smoothing factors or None.
    """

    def __init__(
        self, q_weight: np.ndarray, weight_scale: np.ndarray, smooth: np.ndarray | None = None
    ) -> None:
        out_features, in_features = q_weight.shape
        if in_features > MAX_EXACT_IN_FEATURES:
            raise ValueError(
                f"INT8 projection with {in_features} inputs: the float64 accumulation is exact "
                f"up to {MAX_EXACT_IN_FEATURES}"
            )
        self.wt = np.ascontiguousarray(q_weight.T, np.float64)  # [in, out] exact integers
        self.weight_scale = np.asarray(weight_scale, np.float64).reshape(out_features)
        self.smooth = None if smooth is None else np.asarray(smooth, np.float64)

    @classmethod
    def of(cls, params, name: str) -> QuantLinear:
        """The INT8 projection params[name] with its scale (and smoothing factors, if any)."""
        base = base_name(name)
        smooth = params[base + SMOOTH_SUFFIX] if base + SMOOTH_SUFFIX in params else None
        return cls(params[name], params[base + SCALE_SUFFIX], smooth)

    @property
    def weight(self) -> np.ndarray:
        """The float [out, in] weight this projection stands for (smoothing undone)."""
        w = self.wt.T * self.weight_scale[:, None]
        return w if self.smooth is None else w / self.smooth[None, :]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: [rows, in] float -> [rows, out] in x's dtype."""
        if self.smooth is not None:
            x = x / self.smooth.astype(x.dtype)
        q, scale = quantize_int8(x)  # [rows, in] int8, [rows] float32
        acc = q.astype(np.float64) @ self.wt  # [rows, out] exact INT32 values
        return (acc * scale.astype(np.float64)[:, None] * self.weight_scale).astype(x.dtype)

    def poison(self) -> None:
        """An emulated memory fault: every output becomes NaN."""
        self.weight_scale.fill(np.nan)
