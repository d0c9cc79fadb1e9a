"""A weights file unpacked for the dies: one .npy per tensor beside a meta.json, read with numpy.

Importing h5py costs a die about 0.08 CPU-s (0.073-0.086 s measured; numpy's own import is
about 0.19 s), on every rank, to read a file the launcher has already opened to check its shape.
So the launcher (`unpack`, from `xds-mpi run`, `serve` and `submit`) writes the file's tensors
once per version of the file under the run's output directory, and a die (`find_unpacked`)
reads them with `numpy.load` when they are there and current, else the HDF5 file as before.
A version is the file's absolute path, size and modification time: a retrained checkpoint gets
a directory of its own. The arrays are the file's own float32 values, so no token changes.
The directory is written under a temporary name and renamed into place, so a die never sees
half of one, and two launchers at once both end with the same copy.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

FORMAT = "xds-mpi-unpacked/1"
CACHE_DIR = ".weights"  # under run.output_dir
ATTRS = ("format", "model_config", "quant")  # the file attributes a die reads


def unpacked_dir(output_dir: str | Path, source: str | Path) -> Path:
    """Where `unpack` puts this version of `source`."""
    source = Path(source).resolve()
    stat = source.stat()
    key = zlib.crc32(f"{source}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return Path(output_dir) / CACHE_DIR / f"{source.stem}-{key:08x}"


def unpack(output_dir: str | Path, source: str | Path) -> Path:
    """The unpacked copy of `source` under `output_dir`, written now unless it is there."""
    target = unpacked_dir(output_dir, source)
    if (target / "meta.json").is_file():
        return target
    import shutil  # the launcher's alone, as h5py: a die imports this module to read
    import tempfile

    import h5py

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with h5py.File(source, "r") as f:
            names = list(f.keys())
            for index, name in enumerate(names):
                np.save(staging / f"{index}.npy", f[name][()])
            attrs = {k: str(f.attrs[k]) for k in ATTRS if k in f.attrs}
        meta = {"format": FORMAT, "source": str(Path(source).resolve()), "names": names}
        (staging / "meta.json").write_text(json.dumps({**meta, "attrs": attrs}))
        try:
            staging.rename(target)
        except OSError:  # another launcher renamed its copy first: the same tensors
            if not (target / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


class UnpackedWeights:
    """The tensors of an unpacked weights file, one at a time (the FileWeights of
    xds_mpi/model/weights.py without h5py)."""

    def __init__(self, directory: Path) -> None:
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{directory}: not an unpacked weights directory ({FORMAT})")
        self.directory = directory
        self.attrs: dict[str, str] = meta["attrs"]
        self.index = {name: i for i, name in enumerate(meta["names"])}

    @property
    def names(self) -> list[str]:
        return list(self.index)

    def value(self, name: str) -> np.ndarray:
        return np.load(self.directory / f"{self.index[name]}.npy")


def find_unpacked(output_dir: str | Path | None, source: str | Path) -> UnpackedWeights | None:
    """The current unpacked copy of `source`, or None (none made, or made of another version)."""
    if output_dir is None:
        return None
    try:
        directory = unpacked_dir(output_dir, source)
    except OSError:
        return None
    if not (directory / "meta.json").is_file():
        return None
    return UnpackedWeights(directory)
