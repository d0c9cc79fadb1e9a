"""xds_mpi/model/packed.py: tensors packed into one buffer read back exactly (a round trip), each
at an aligned offset with a sentinel after the last; a checksum sees one flipped byte; a die's
tensors are all but the routed experts it does not host."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.model.packed import (
    ALIGN,
    PackedLayout,
    PackedWeights,
    checksums,
    die_tensor_names,
    pack_into,
    routed_expert_of,
)


def _arrays() -> dict[str, np.ndarray]:
    # each value says where it came from: tensor k holds k * 1000 + its index
    shapes = {"embed.weight": (5, 3), "layers.0.attn_norm.weight": (3,), "head.q": (2, 7)}
    dtypes = (np.float32, np.float32, np.int8)
    return {
        name: (k * 1000 + np.arange(np.prod(shape))).reshape(shape).astype(dtype)
        if dtype != np.int8
        else (np.arange(np.prod(shape)) - 7).reshape(shape).astype(dtype)
        for k, ((name, shape), dtype) in enumerate(zip(shapes.items(), dtypes, strict=True))
    }


def test_packed_tensors_read_back_exactly_at_aligned_offsets():
    arrays = _arrays()
    layout = PackedLayout.of_arrays(arrays)
    assert [t.offset % ALIGN for t in layout.tensors] == [0, 0, 0]
    assert layout.nbytes % ALIGN == 0 and layout.tensor_bytes == sum(
        a.nbytes for a in arrays.values()
    )
    buffer = np.full(layout.nbytes + 8, 0xAB, np.uint8)  # 8 sentinel bytes after the layout
    pack_into(buffer, layout, arrays)
    weights = PackedWeights(buffer, layout, "test")
    for name, value in arrays.items():
        got = weights.value(name)
        assert got.dtype == value.dtype and np.array_equal(got, value), name
    assert (buffer[layout.nbytes :] == 0xAB).all()  # nothing written past the layout
    with pytest.raises(KeyError, match="not among its weights"):
        weights.value("layers.9.ffn.experts.0.w1.weight")


def test_a_checksum_sees_one_flipped_byte_and_a_wrong_shape_is_refused():
    arrays = _arrays()
    layout = PackedLayout.of_arrays(arrays)
    buffer = np.zeros(layout.nbytes, np.uint8)
    pack_into(buffer, layout, arrays)
    before = checksums(buffer, layout)
    tensor = layout.find("layers.0.attn_norm.weight")
    buffer[tensor.offset + 5] ^= 1
    after = checksums(buffer, layout)
    assert [n for n in before if before[n] != after[n]] == ["layers.0.attn_norm.weight"]
    with pytest.raises(ValueError, match="does not fit"):
        pack_into(buffer, layout, {**arrays, "head.q": np.zeros((7, 2), np.int8)})


def test_a_die_holds_every_tensor_but_the_routed_experts_it_does_not_host():
    names = [
        "embed.weight",
        "layers.1.ffn.gate.weight",
        "layers.1.ffn.experts.0.w1.weight",
        "layers.1.ffn.experts.1.w1.weight",
        "layers.1.ffn.experts.12.w2.weight",
        "layers.1.ffn.shared_experts.0.w1.weight",
        "mtp.0.block.ffn.experts.1.w3.weight",
    ]
    assert [routed_expert_of(n) for n in names] == [None, None, 0, 1, 12, None, 1]
    assert die_tensor_names(names, {1, 12}) == [
        "embed.weight",
        "layers.1.ffn.gate.weight",
        "layers.1.ffn.experts.1.w1.weight",
        "layers.1.ffn.experts.12.w2.weight",
        "layers.1.ffn.shared_experts.0.w1.weight",
        "mtp.0.block.ffn.experts.1.w3.weight",
    ]
