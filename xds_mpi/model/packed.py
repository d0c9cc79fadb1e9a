"""Tensors packed back to back in one flat byte buffer, as stored (dtype and shape of the
weights file): a die's weights in its window, or the whole model in a host rank's window
(docs/scaling.md, "Weights at scale-out"). Two ranks that build the layout of the same tensor
specs get the same offsets, so a die reads a tensor of a peer's buffer without asking where it
lies. numpy and zlib only: a die imports this.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

ALIGN = 64  # each tensor's offset (a window's size stays a multiple of 8, as RMA windows need)
# A routed expert's tensors: "layers.3.ffn.experts.7.w1.weight" (not "shared_experts.0.").
_ROUTED = re.compile(r"(?:^|\.)experts\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class PackedTensor:
    """One tensor of a layout: name, byte offset in the buffer, stored dtype (numpy's str)
    and shape."""

    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, kw_only=True)
class PackedLayout:
    """tensors: in packing order; nbytes: the buffer's size (a multiple of ALIGN, padding
    included)."""

    tensors: tuple[PackedTensor, ...]
    nbytes: int

    @classmethod
    def of(cls, specs: Iterable[tuple[str, np.dtype, tuple[int, ...]]]) -> PackedLayout:
        """specs: (name, dtype, shape) in packing order."""
        tensors, at = [], 0
        for name, dtype, shape in specs:
            tensor = PackedTensor(
                name=name, offset=at, dtype=np.dtype(dtype).str, shape=tuple(shape)
            )
            tensors.append(tensor)
            at += tensor.nbytes
            at += -at % ALIGN
        return cls(tensors=tuple(tensors), nbytes=at)

    @classmethod
    def of_arrays(cls, arrays: Mapping[str, np.ndarray]) -> PackedLayout:
        return cls.of((name, a.dtype, a.shape) for name, a in arrays.items())

    @property
    def tensor_bytes(self) -> int:
        """The tensors' bytes, padding not counted: what a load moves."""
        return sum(t.nbytes for t in self.tensors)

    def find(self, name: str) -> PackedTensor:
        index = self.__dict__.get("_index")
        if index is None:  # built once (the dataclass is frozen)
            index = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_index", index)
        return index[name]


def tensor_bytes(buffer: np.ndarray, tensor: PackedTensor) -> np.ndarray:
    """The tensor's bytes in `buffer` (uint8, a view)."""
    return buffer[tensor.offset : tensor.offset + tensor.nbytes]


def pack_into(buffer: np.ndarray, layout: PackedLayout, arrays: Mapping[str, np.ndarray]) -> None:
    """Write every tensor of `layout` from `arrays` (name -> its stored array) into `buffer`
    (uint8, at least layout.nbytes)."""
    for tensor in layout.tensors:
        value = np.ascontiguousarray(arrays[tensor.name])
        if value.dtype.str != tensor.dtype or value.shape != tensor.shape:
            raise ValueError(
                f"{tensor.name}: {value.dtype.str} {value.shape} does not fit the layout's "
                f"{tensor.dtype} {tensor.shape}"
            )
        tensor_bytes(buffer, tensor)[:] = value.reshape(-1).view(np.uint8)


def checksum(data: np.ndarray) -> int:
    """CRC-32 of an array's bytes."""
    return zlib.crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def checksums(buffer: np.ndarray, layout: PackedLayout) -> dict[str, int]:
    """name -> CRC-32 of each tensor's bytes in `buffer`."""
    return {t.name: checksum(tensor_bytes(buffer, t)) for t in layout.tensors}


def routed_expert_of(name: str) -> int | None:
    """The routed expert a tensor belongs to, or None (attention, norms, dense FFN, gate,
    shared experts, embedding, head)."""
    match = _ROUTED.search(name)
    return int(match.group(1)) if match else None


def die_tensor_names(names: Iterable[str], hosted: set[int]) -> list[str]:
    """The tensors a colocated die computes with: all but the routed experts it does not host
    (DP attention holds every other tensor; xds_mpi/execution/executor.py)."""
    return [n for n in names if (e := routed_expert_of(n)) is None or e in hosted]


class PackedWeights:
    """The tensors of `layout` in `buffer` as a weight source (xds_mpi/model/params.py):
    `value` returns a copy, so the buffer (a window) stays the one shared copy."""

    def __init__(self, buffer: np.ndarray, layout: PackedLayout, where: str) -> None:
        self.buffer, self.layout, self.where = buffer, layout, where

    def value(self, name: str) -> np.ndarray:
        try:
            tensor = self.layout.find(name)
        except KeyError:
            raise KeyError(f"{self.where}: tensor {name!r} is not among its weights") from None
        raw = tensor_bytes(self.buffer, tensor)
        return raw.view(np.dtype(tensor.dtype)).reshape(tensor.shape).copy()
