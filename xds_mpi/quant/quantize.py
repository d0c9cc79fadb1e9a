"""A float checkpoint -> an INT8 checkpoint the dies load like the float one.

Per projection (xDeepServe §4.7): (1) smoothing factors from the calibration activations
(`smoothing.py`), folded into the weight's input columns and stored for the activation side;
(2) per-output-channel INT8 weights, by GPTQ against the calibration Hessian (`gptq.py`) or
round-to-nearest. Routed experts with fewer calibration rows than the minimum get RTN without
smoothing. The file keeps every float tensor (gate, Wkv_b, norms, embedding, head, eh_proj) as
float32, the INT8 integers as int8, and says what it did in its `quant` attribute.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.checkpoint import FORMAT
from xds_mpi.model.qlinear import (
    SCALE_SUFFIX,
    SMOOTH_SUFFIX,
    base_name,
    dequantize_weight,
    quantize_rtn,
)
from xds_mpi.quant.calibrate import Calibration
from xds_mpi.quant.gptq import gptq_quantize, output_error
from xds_mpi.quant.smoothing import smooth, smoothing_factors

METHODS = ("rtn", "smooth", "gptq", "smooth+gptq")


@dataclass(frozen=True, kw_only=True)
class QuantOptions:
    method: str = "smooth+gptq"
    alpha: float = 0.5  # SmoothQuant's migration strength

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization method {self.method!r}: choose one of {METHODS}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"smoothing alpha must lie in [0, 1], got {self.alpha}")

    @property
    def is_smoothed(self) -> bool:
        return self.method.startswith("smooth")

    @property
    def uses_gptq(self) -> bool:
        return self.method.endswith("gptq")


def quantize_projection(
    weight: np.ndarray, stats, options: QuantOptions, *, is_short: bool
) -> dict[str, np.ndarray]:
    """One projection [out, in] -> its INT8 tensors: "q" int8, "scale" [out], "smooth" [in],
    and "error": the weights' share of output error on the calibration rows, trace(D H D^T) /
    trace(W H W^T) with D = W - dequantized (the same in the smoothed space)."""
    weight = np.asarray(weight, np.float64)
    hessian, out = stats.hessian, {}
    if options.is_smoothed and not is_short:
        s = smoothing_factors(stats.absmax, weight, options.alpha)
        weight, hessian, _ = smooth(weight, hessian, stats.absmax, s)
        out["smooth"] = s
    if options.uses_gptq and not is_short:
        out["q"], out["scale"] = gptq_quantize(weight, hessian)
    else:
        out["q"], out["scale"] = quantize_rtn(weight)
    signal = output_error(weight, np.zeros_like(weight), hessian)
    approx = dequantize_weight(out["q"], out["scale"])
    out["error"] = output_error(weight, approx, hessian) / signal if signal > 0 else 0.0
    return out


def quantize_state(
    state: dict[str, np.ndarray], calibration: Calibration, options: QuantOptions
) -> tuple[dict[str, np.ndarray], dict]:
    """Float tensors by name -> (INT8 checkpoint tensors, the `quant` description)."""
    short = calibration.short_experts
    out = dict(state)
    smoothed, fallback, errors = [], [], []
    for name, stats in calibration.stats.items():
        is_short = name.startswith(tuple(short))
        tensors = quantize_projection(state[name], stats, options, is_short=is_short)
        out[name] = tensors["q"]
        out[base_name(name) + SCALE_SUFFIX] = tensors["scale"]
        if "smooth" in tensors:
            out[base_name(name) + SMOOTH_SUFFIX] = tensors["smooth"]
            smoothed.append(name)
        if is_short:
            fallback.append(name)
        errors.append(tensors["error"])
    counts = [n for per_layer in calibration.expert_tokens.values() for n in per_layer]
    info = {
        "method": options.method,
        "alpha": options.alpha,
        "projections": list(calibration.stats),
        "smoothed": smoothed,
        "rtn_fallback": fallback,
        "weight_error_mean": float(np.mean(errors)) if errors else 0.0,
        "calibration": {
            "windows": calibration.num_windows,
            "window_len": calibration.window_len,
            "tokens": calibration.num_windows * calibration.window_len,
            "min_tokens_per_expert": calibration.min_tokens_per_expert,
            "expert_tokens_min": min(counts, default=0),
            "expert_tokens_max": max(counts, default=0),
            "short_experts": short,
        },
    }
    return out, info


def save_quantized(
    cfg: ModelConfig, state: dict[str, np.ndarray], info: dict, path: str | Path
) -> None:
    """The INT8 checkpoint: int8 tensors as int8, every other tensor as float32."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["model_config"] = json.dumps(dataclasses.asdict(cfg))
        f.attrs["quant"] = json.dumps(info)
        for name, value in state.items():
            value = np.asarray(value)
            f.create_dataset(
                name, data=value if value.dtype == np.int8 else value.astype(np.float32)
            )
