"""Model weights: seeded random init, and HDF5 files that carry their ModelConfig.

Weights are float32 values whatever the compute dtype, so a float64 run and a float32 run start
from the same numbers and a file round trip is exact. Each tensor draws from its own generator,
seeded by (seed, tensor name): changing one module's shape never shifts another's weights.
`model.weights` is "random", the name of a checkpoint shipped in xds_mpi/data/ ("tiny", written by
`xds-mpi train-tiny`), or the path of an HDF5 file. numpy and h5py only: the dies load weights
without torch (the trainer hands its tensors over as arrays, xds_mpi/train/torch_model.py).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import numpy as np

from xds_mpi.config.schema import ConfigError, ModelConfig
from xds_mpi.model import unpacked
from xds_mpi.model.checkpoint import (
    FORMAT,
    check_same_shape,
    checkpoint_shapes,
    config_from_attrs,
    quant_from_attrs,
    read_checkpoint_config,
    weights_path,
)
from xds_mpi.model.params import LazyParams, WeightSource
from xds_mpi.model.transformer import DeepSeekModel, param_shapes

GATE_BIAS_STD = 0.02


def _init_value(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """One tensor's float32 initial value from its own generator."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    normal = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("gate.bias"):
        return normal * np.float32(GATE_BIAS_STD)
    if name == "embed.weight":
        return normal
    return normal / np.float32(shape[-1] ** 0.5)  # fan-in


def init_state(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded random weights (float32) for every tensor of the model."""
    return {name: _init_value(name, shape, seed) for name, shape in param_shapes(cfg).items()}


def save_weights(cfg: ModelConfig, state: dict[str, np.ndarray], path: str | Path) -> None:
    """state: tensor name -> array (any float dtype; stored as float32)."""
    import h5py  # where a file is read or written: random weights need none

    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["model_config"] = json.dumps(dataclasses.asdict(cfg))
        for name, value in state.items():
            f.create_dataset(name, data=np.asarray(value, np.float32))


def read_weights(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The file's ModelConfig (weights = the path) and its tensors by name."""
    cfg = read_checkpoint_config(path)
    import h5py  # only where a file is read or written (see above)

    with h5py.File(path, "r") as f:
        tensors = {name: f[name][()] for name in f.keys()}
    return cfg, tensors


def check_names(cfg: ModelConfig, names, where: str, shapes=None) -> None:
    """The tensors `names` must be exactly the model's (`shapes`, default `param_shapes`)."""
    wrong = sorted(set(param_shapes(cfg) if shapes is None else shapes) ^ set(names))
    if wrong:
        raise ConfigError(f"{where}: tensors missing or unexpected: {', '.join(wrong[:8])}")


class RandomWeights:
    """The seeded random weights of `cfg`, one tensor at a time (each from its own generator, so
    drawing one alone gives the same values as drawing them all)."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.shapes, self.seed = param_shapes(cfg), seed

    def value(self, name: str) -> np.ndarray:
        return _init_value(name, self.shapes[name], self.seed)

    def unpacked_dir(self, output_dir: str | Path) -> Path:
        """Where `unpack_random` puts these weights: named by the seed, every tensor's shape,
        how a value is drawn (_init_value's code) and numpy's version (its generators' streams
        may change between versions), so a copy is never of other values."""
        init = _init_value.__code__
        key = "|".join(
            (
                unpacked.FORMAT,
                str(self.seed),
                repr(sorted(self.shapes.items())),
                np.__version__,
                repr(init.co_code),
                repr(init.co_consts),
                str(GATE_BIAS_STD),
            )
        )
        return Path(output_dir) / unpacked.CACHE_DIR / f"random-{zlib.crc32(key.encode()):08x}"

    def drawn(self, output_dir: str | Path | None) -> unpacked.UnpackedWeights | None:
        """The launcher's copy of these weights under `output_dir` (`unpack_random`), if any:
        the same values, mapped instead of drawn."""
        if output_dir is None:
            return None
        try:
            return unpacked.open_unpacked(self.unpacked_dir(output_dir))
        except OSError:
            return None


def unpack_random(cfg: ModelConfig, output_dir: str | Path) -> Path:
    """The launcher: `cfg`'s random weights drawn once and written for the dies to map
    (xds_mpi/model/unpacked.py), unless they are there. Importing numpy's generators and drawing
    the tensors cost every die of a 64-die run ~50 ms of start-up CPU."""
    source = RandomWeights(cfg, cfg.seed)
    target = source.unpacked_dir(output_dir)
    if unpacked.open_unpacked(target) is None:
        tensors = ((name, source.value(name)) for name in source.shapes)
        unpacked.write_unpacked(target, tensors, {}, f"random, seed {cfg.seed}")
    return target


class FileWeights:
    """The tensors of an HDF5 weights file, one at a time; the file stays open for reading."""

    def __init__(self, path: str | Path) -> None:
        import h5py  # only where a file is read or written (see above)

        self.file = h5py.File(path, "r")
        self.attrs = self.file.attrs

    @property
    def names(self) -> list[str]:
        return list(self.file.keys())

    def value(self, name: str) -> np.ndarray:
        return self.file[name][()]


def stored_weights(
    cfg: ModelConfig, *, unpacked_under: str | Path | None = None
) -> tuple[WeightSource, dict[str, tuple[int, ...]], ModelConfig]:
    """What `build_model` reads: (the weights as stored: the launcher's unpacked copy under
    `unpacked_under` when there is a current one, else the file or the seeded draw; every
    tensor's shape; the model config, a checkpoint's own). cfg.weights "random": weights from
    cfg.seed; otherwise a packaged checkpoint or a file, whose shape must be cfg's."""
    if cfg.weights == "random":
        source = RandomWeights(cfg, cfg.seed)
        return source.drawn(unpacked_under) or source, source.shapes, cfg
    path = weights_path(cfg.weights)
    if not Path(path).is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    source = unpacked.find_unpacked(unpacked_under, path) or FileWeights(path)
    file_cfg = config_from_attrs(source.attrs, path)
    check_same_shape(cfg, file_cfg)
    shapes = checkpoint_shapes(file_cfg, quant_from_attrs(source.attrs), str(path))
    check_names(file_cfg, source.names, str(path), shapes)
    return source, shapes, file_cfg


def load_model(
    path: str | Path,
    *,
    dtype=np.float64,
    expected: ModelConfig | None = None,
    unpacked_under: str | Path | None = None,
) -> DeepSeekModel:
    """A model built from the file's own config; `expected` (if given) must match its shape.
    Tensors are read when first used (a die reads only the experts it hosts), from the file's
    unpacked copy under `unpacked_under` when the launcher made a current one
    (xds_mpi/model/unpacked.py: numpy alone, no h5py), else from the file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    source = unpacked.find_unpacked(unpacked_under, path) or FileWeights(path)
    cfg = config_from_attrs(source.attrs, path)
    if expected is not None:
        check_same_shape(expected, cfg)
    shapes = checkpoint_shapes(cfg, quant_from_attrs(source.attrs), str(path))
    check_names(cfg, source.names, str(path), shapes)
    return DeepSeekModel(cfg, LazyParams(shapes, source, dtype), dtype=dtype)


def build_model(
    cfg: ModelConfig,
    *,
    dtype=np.float64,
    unpacked_under: str | Path | None = None,
    source: WeightSource | None = None,
) -> DeepSeekModel:
    """cfg.weights "random": weights from cfg.seed; otherwise a packaged checkpoint or a file.
    Either from the launcher's unpacked copy under `unpacked_under` when there is a current one
    (the dies pass their run.output_dir). Either way a tensor is made when first used, so a
    die holds only what it touches. source: read the tensors from it instead (a standby die's
    window, filled at scale-out: xds_mpi/model/packed.py), with the stored file's shapes."""
    stored, shapes, model_cfg = stored_weights(cfg, unpacked_under=unpacked_under)
    return DeepSeekModel(model_cfg, LazyParams(shapes, source or stored, dtype), dtype=dtype)
