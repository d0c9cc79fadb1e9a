"""What a weights file says about itself, read without torch: its format and ModelConfig.

`DeploymentPlan.build` calls `check_checkpoint` so that `xds-mpi validate`, `run` and `submit`
refuse a checkpoint of another model shape before launch (every rank would otherwise die loading
it); xds_mpi/model/weights.py loads the tensors and runs the same check.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from xds_mpi.config.schema import ConfigError, ModelConfig
from xds_mpi.model.qlinear import (
    MAX_EXACT_IN_FEATURES,
    is_quantizable,
    quant_tensor_shapes,
)
from xds_mpi.model.transformer import param_shapes

FORMAT = "xds-mpi-weights/1"
# Fields that say where weights come from rather than what shape the model has.
PROVENANCE_FIELDS = ("weights", "seed")
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
# model.weights name -> file in DATA_DIR; tiny-int8 is `xds-mpi quantize` of tiny (docs/int8.md)
PACKAGED_WEIGHTS = {"tiny": "tiny.h5", "tiny-int8": "tiny_int8.h5"}


def weights_path(weights: str) -> Path:
    """A packaged checkpoint name ("tiny") or an HDF5 path -> the file's path."""
    if weights in PACKAGED_WEIGHTS:
        return DATA_DIR / PACKAGED_WEIGHTS[weights]
    return Path(weights)


def read_checkpoint_config(path: str | Path) -> ModelConfig:
    """The ModelConfig a weights file was saved with (weights = the path); attributes only."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    import h5py  # here, not at the top: a die with random weights never reads a file

    with h5py.File(path, "r") as f:
        return config_from_attrs(f.attrs, path)


def config_from_attrs(attrs, path: str | Path) -> ModelConfig:
    """The ModelConfig in a weights file's attributes (the file's, or its unpacked copy's)."""
    if attrs.get("format") != FORMAT:
        raise ConfigError(
            f"{path}: not an xds-mpi weights file (format "
            f"{attrs.get('format')!r}, expected {FORMAT!r})"
        )
    values = json.loads(attrs["model_config"])
    return ModelConfig(**{**values, "weights": str(path)})


def read_quant_info(path: str | Path) -> dict | None:
    """An INT8 checkpoint's description (`xds-mpi quantize`, xds_mpi/quant/): method, the
    quantized and smoothed projections, calibration counts; None for a float checkpoint."""
    import h5py  # only where a file is read or written (see above)

    with h5py.File(path, "r") as f:
        return quant_from_attrs(f.attrs)


def quant_from_attrs(attrs) -> dict | None:
    info = attrs.get("quant")
    return None if info is None else json.loads(info)


def check_same_shape(expected: ModelConfig, found: ModelConfig) -> None:
    """Refuse `found` (a file's config) unless every shape field equals `expected`'s."""
    diffs = [
        f"model.{f.name}: checkpoint {getattr(found, f.name)} vs config {getattr(expected, f.name)}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in PROVENANCE_FIELDS and getattr(expected, f.name) != getattr(found, f.name)
    ]
    if diffs:
        raise ConfigError(
            f"model.weights({expected.weights}): {found.weights} was saved for another model "
            f"shape ({'; '.join(diffs)}): set those fields back to the checkpoint's values, or "
            "--set model.weights=random for seeded weights of any shape (`xds-mpi train-tiny` "
            "trains checkpoints of the tiny shape, configs/model/tiny.yaml)"
        )


def checkpoint_shapes(cfg: ModelConfig, quant: dict | None, where: str) -> dict:
    """Every tensor a checkpoint of `cfg` holds: the model's, plus an INT8 checkpoint's scales
    and smoothing factors (`quant`: its read_quant_info)."""
    shapes = param_shapes(cfg)
    if quant is None:
        return shapes
    wrong = [n for n in quant["projections"] if n not in shapes or not is_quantizable(n)]
    if wrong:
        raise ConfigError(f"{where}: cannot hold INT8 projections {', '.join(wrong[:8])}")
    too_wide = [n for n in quant["projections"] if shapes[n][1] > MAX_EXACT_IN_FEATURES]
    if too_wide:
        raise ConfigError(
            f"{where}: INT8 projection {too_wide[0]} has {shapes[too_wide[0]][1]} inputs; the "
            f"emulated INT32 accumulation is exact up to {MAX_EXACT_IN_FEATURES}"
        )
    smoothed = set(quant["smoothed"])
    extra = {}
    for name in quant["projections"]:
        extra |= quant_tensor_shapes(shapes, name, is_smoothed=name in smoothed)
    return shapes | extra


def check_tensors(cfg: ModelConfig, path: Path) -> None:
    """The file holds exactly the tensors its config (and INT8 description) says, with their
    shapes, and the INT8 projections as int8: metadata only, no tensor is read."""
    quant = read_quant_info(path)
    shapes = checkpoint_shapes(cfg, quant, str(path))
    quantized = set((quant or {}).get("projections", ()))
    import h5py  # only where a file is read or written (see above)

    with h5py.File(path, "r") as f:
        wrong = sorted(set(shapes) ^ set(f.keys()))
        if wrong:
            raise ConfigError(f"{path}: tensors missing or unexpected: {', '.join(wrong[:8])}")
        for name, shape in shapes.items():
            found = f[name]
            if tuple(found.shape) != tuple(shape) or (name in quantized) != (found.dtype == "i1"):
                raise ConfigError(
                    f"{path}: tensor {name} is {found.dtype}{list(found.shape)}, expected "
                    f"{'int8' if name in quantized else 'float'}{list(shape)}"
                )


def check_checkpoint(model: ModelConfig) -> None:
    """model.weights names a checkpoint: it must exist, have the config's model shape and hold
    the tensors that shape (and, for an INT8 checkpoint, its description) asks for."""
    if model.weights != "random":
        path = weights_path(model.weights)
        found = read_checkpoint_config(path)
        check_same_shape(model, found)
        check_tensors(found, path)
