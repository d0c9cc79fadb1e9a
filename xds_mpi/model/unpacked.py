"""A weights file unpacked for the dies: its tensors in one flat file beside a meta.json.

Importing h5py costs a die about 0.08 CPU-s (0.073-0.086 s measured; numpy's own import is
about 0.19 s), on every rank, to read a file the launcher has already opened to check its shape.
So the launcher (`unpack`, from `xds-mpi run`, `serve` and `submit`) writes the file's tensors
once per version of the file under the run's output directory, and a die (`find_unpacked`)
maps them with numpy when they are there and current, else reads the HDF5 file as before.
The tensors lie back to back in `tensors.bin` (each at a 64-byte boundary, as stored: dtype and
shape in meta.json), and a die maps the file once and copies a tensor out when it first uses it.
The first layout, one .npy per tensor (a file to open and a header to parse for each), made the
main job's first iteration, where a die first uses its 36 tensors and which every die waits for
at each MoE layer, cost 50 ms of CPU per die; the flat file 36 ms (3 alternated runs each).
A version is the file's absolute path, size and modification time (and this module's FORMAT): a
retrained checkpoint gets a directory of its own. The arrays are the file's own values, so no
token changes.
The directory is written under a temporary name and renamed into place, so a die never sees
half of one, and two launchers at once both end with the same copy.
Random weights (`model.weights: random`) are drawn once by the launcher into the same format
(`write_unpacked`, from xds_mpi/model/weights.py `unpack_random`), so a die neither imports
numpy's generators nor draws.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FORMAT = "xds-mpi-unpacked/2"
DATA = "tensors.bin"
ALIGN = 64
CACHE_DIR = ".weights"  # under run.output_dir
ATTRS = ("format", "model_config", "quant")  # the file attributes a die reads


def unpacked_dir(output_dir: str | Path, source: str | Path) -> Path:
    """Where `unpack` puts this version of `source`."""
    source = Path(source).resolve()
    stat = source.stat()
    key = zlib.crc32(f"{FORMAT}|{source}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return Path(output_dir) / CACHE_DIR / f"{source.stem}-{key:08x}"


def unpack(output_dir: str | Path, source: str | Path) -> Path:
    """The unpacked copy of `source` under `output_dir`, written now unless it is there."""
    target = unpacked_dir(output_dir, source)
    if (target / "meta.json").is_file():
        return target
    import h5py  # the launcher's alone: a die imports this module to read

    with h5py.File(source, "r") as f:
        attrs = {k: str(f.attrs[k]) for k in ATTRS if k in f.attrs}
        tensors = ((name, f[name][()]) for name in f.keys())
        return write_unpacked(target, tensors, attrs, str(Path(source).resolve()))


def write_unpacked(
    target: Path, tensors: Iterable[tuple[str, np.ndarray]], attrs: dict, source: str
) -> Path:
    """`tensors` (name, array) back to back into `target` (made under a temporary name and
    renamed into place), with `attrs` and the name of their `source` in its meta.json."""
    import shutil  # the launcher's alone
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        layout: dict[str, list] = {}  # name -> [offset, dtype, shape]
        with open(staging / DATA, "wb") as out:
            for name, value in tensors:
                value = np.ascontiguousarray(value)
                out.write(bytes(-out.tell() % ALIGN))
                layout[name] = [out.tell(), value.dtype.str, list(value.shape)]
                out.write(value.tobytes())
        meta = {"format": FORMAT, "source": source, "tensors": layout, "attrs": attrs}
        (staging / "meta.json").write_text(json.dumps(meta))
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
        self.tensors: dict[str, list] = meta["tensors"]
        size = (directory / DATA).stat().st_size
        # Mapped, not read: a die touches only the pages of the tensors it uses.
        self.data = np.memmap(directory / DATA, np.uint8, "r") if size else np.zeros(0, np.uint8)

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def value(self, name: str) -> np.ndarray:
        """A copy (the mapping is read-only and stays shared)."""
        offset, dtype, shape = self.tensors[name]
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        flat = np.frombuffer(self.data, dtype, count, offset)
        return flat.reshape(shape).copy()


def find_unpacked(output_dir: str | Path | None, source: str | Path) -> UnpackedWeights | None:
    """The current unpacked copy of `source`, or None (none made, or made of another version)."""
    if output_dir is None:
        return None
    try:
        directory = unpacked_dir(output_dir, source)
    except OSError:
        return None
    return open_unpacked(directory)


def open_unpacked(directory: Path) -> UnpackedWeights | None:
    """The unpacked weights in `directory`, or None where there are none."""
    if not (directory / "meta.json").is_file():
        return None
    return UnpackedWeights(directory)
