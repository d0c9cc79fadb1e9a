"""A model's parameters as a mapping that makes each tensor when it is first read.

At pod scale every die would otherwise build every routed expert of every layer: 256 experts of
the tiny shape are ~150 MiB of float64 per die, 43 GiB over ep288's 288 dies, while a die uses
the few it hosts. `LazyParams` reads (or draws) a tensor on first access and keeps it in the
compute dtype; `LazyList` builds list items (the routed experts) the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Generic, Protocol, TypeVar

import numpy as np

T = TypeVar("T")


class WeightSource(Protocol):
    def value(self, name: str) -> np.ndarray:
        """The tensor `name` as stored (any float dtype)."""


class LazyParams(MutableMapping):
    """name -> array in `dtype` (contiguous), made from `source` on first access. Every name of
    `shapes` is a key; assigning a name replaces its array (Linear keeps one copy that way)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], source: WeightSource, dtype):
        self.shapes, self.source, self.dtype = shapes, source, np.dtype(dtype)
        self.made: dict[str, np.ndarray] = {}

    @classmethod
    def of_arrays(cls, arrays: Mapping[str, np.ndarray], dtype) -> LazyParams:
        """In-memory arrays (the trainer's, a test's) behind the same interface."""
        return cls({n: np.shape(a) for n, a in arrays.items()}, _Arrays(arrays), dtype)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.made:
            if name not in self.shapes:
                raise KeyError(name)
            self.made[name] = np.ascontiguousarray(self.source.value(name), self.dtype)
        return self.made[name]

    def __contains__(self, name) -> bool:  # without making the tensor
        return name in self.shapes

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self.made[name] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("a model's parameters cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class _Arrays:
    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = arrays

    def value(self, name: str) -> np.ndarray:
        return self.arrays[name]


class LazyList(Generic[T]):
    """A fixed-length sequence whose item i is `make(i)`, made on first access and kept."""

    def __init__(self, length: int, make: Callable[[int], T]) -> None:
        self.make, self.items = make, [None] * length

    def __getitem__(self, idx: int) -> T:
        item = self.items[idx]
        if item is None:
            item = self.items[idx] = self.make(idx)
        return item

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[T]:
        return (self[i] for i in range(len(self.items)))
