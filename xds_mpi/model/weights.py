"""Model weights: seeded random init, and HDF5 files that carry their ModelConfig.

Weights are float32 values whatever the compute dtype, so a float64 run and a float32 run start
from the same numbers and a file round trip is exact. Each tensor draws from its own generator,
seeded by (seed, tensor name): changing one module's shape never shifts another's weights.
`model.weights` is "random", the name of a checkpoint shipped in xds_mpi/data/ ("tiny", written by
`xds-mpi train-tiny`), or the path of an HDF5 file.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import h5py
import numpy as np
import torch

from xds_mpi.config.schema import ConfigError, ModelConfig
from xds_mpi.model.checkpoint import (
    FORMAT,
    check_same_shape,
    read_checkpoint_config,
    weights_path,
)
from xds_mpi.model.transformer import DeepSeekModel

GATE_BIAS_STD = 0.02


def _init_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("gate.bias"):
        return torch.randn(shape, generator=gen) * GATE_BIAS_STD
    if name == "embed.weight":
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) / fan_in**0.5


def init_weights(model: DeepSeekModel, seed: int) -> None:
    for name, param in model.named_parameters():
        param.copy_(_init_value(name, param.shape, seed).to(param.dtype))


def save_weights(model: DeepSeekModel, path: str | Path) -> None:
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["model_config"] = json.dumps(dataclasses.asdict(model.cfg))
        for name, tensor in model.state_dict().items():
            f.create_dataset(name, data=tensor.to(torch.float32).numpy())


def read_weights(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The file's ModelConfig (weights = the path) and its tensors by name."""
    cfg = read_checkpoint_config(path)
    with h5py.File(path, "r") as f:
        tensors = {name: f[name][()] for name in f.keys()}
    return cfg, tensors


def load_model(
    path: str | Path, *, dtype: torch.dtype = torch.float64, expected: ModelConfig | None = None
) -> DeepSeekModel:
    """A model built from the file's own config; `expected` (if given) must match its shape."""
    cfg, tensors = read_weights(path)
    if expected is not None:
        check_same_shape(expected, cfg)
    model = DeepSeekModel(cfg, dtype=dtype)
    state = {name: torch.from_numpy(value) for name, value in tensors.items()}
    missing = sorted(set(model.state_dict()) ^ set(state))
    if missing:
        raise ConfigError(f"{path}: tensors missing or unexpected: {', '.join(missing[:8])}")
    model.load_state_dict(state)
    return model


def build_model(cfg: ModelConfig, *, dtype: torch.dtype = torch.float64) -> DeepSeekModel:
    """cfg.weights "random": weights from cfg.seed; otherwise a packaged checkpoint or a file."""
    if cfg.weights != "random":
        return load_model(weights_path(cfg.weights), dtype=dtype, expected=cfg)
    model = DeepSeekModel(cfg, dtype=dtype)
    init_weights(model, cfg.seed)
    return model
