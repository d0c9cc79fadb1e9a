"""The launcher's unpacked copy of a checkpoint (xds_mpi/model/unpacked.py): the file's own
tensors and attributes, read by a die with numpy alone, and never a stale copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
from harness import REPO_ROOT

from xds_mpi.model.checkpoint import weights_path
from xds_mpi.model.unpacked import find_unpacked, unpack


def test_the_copy_holds_the_files_tensors_and_attributes(tmp_path):
    source = weights_path("tiny")
    found = find_unpacked(tmp_path, source)
    assert found is None  # nothing unpacked yet
    directory = unpack(tmp_path, source)
    assert unpack(tmp_path, source) == directory  # once per version
    copy = find_unpacked(tmp_path, source)
    with h5py.File(source, "r") as f:
        assert sorted(copy.names) == sorted(f.keys())
        for name in f.keys():
            want = f[name][()]
            got = copy.value(name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        assert copy.attrs["model_config"] == f.attrs["model_config"]
        assert copy.attrs["format"] == f.attrs["format"]


def test_a_changed_file_is_not_read_from_its_old_copy(tmp_path):
    source = tmp_path / "ckpt.h5"
    shutil.copy(weights_path("tiny"), source)
    unpack(tmp_path, source)
    assert find_unpacked(tmp_path, source) is not None
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # "retrained"
    assert find_unpacked(tmp_path, source) is None


def test_a_die_built_from_the_copy_imports_no_h5py_and_decodes_the_same_tokens(tmp_path):
    unpack(tmp_path, weights_path("tiny"))
    code = (
        "import sys\n"
        "from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator\n"
        "from xds_mpi.model.shapes import load_model_preset\n"
        "from xds_mpi.model.weights import build_model\n"
        "cfg = load_model_preset('tiny')\n"
        f"model = build_model(cfg, unpacked_under={str(tmp_path)!r})\n"
        "out = ReferenceGenerator(model, GenerateOptions(max_new_tokens=12, mtp_depth=1))"
        ".generate([[256, 104, 105]])\n"
        "print('h5py' in sys.modules, out[0].tokens)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    from_copy = run.stdout.strip()
    run = subprocess.run(
        [sys.executable, "-c", code.replace(f"unpacked_under={str(tmp_path)!r}", "")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    )
    from_file = run.stdout.strip()
    assert from_copy.startswith("False "), from_copy
    assert from_file.startswith("True "), from_file  # the file itself: through h5py
    assert from_copy.split(" ", 1)[1] == from_file.split(" ", 1)[1]


def _random_tiny(**changes):
    import dataclasses

    from xds_mpi.model.shapes import load_model_preset

    return dataclasses.replace(load_model_preset("tiny"), weights="random", **changes)


def test_random_weights_are_drawn_once_and_the_copy_holds_the_drawn_values(tmp_path):
    from xds_mpi.model.weights import RandomWeights, unpack_random

    cfg = _random_tiny()
    drawn = RandomWeights(cfg, cfg.seed)
    assert drawn.drawn(tmp_path) is None  # nothing drawn yet
    directory = unpack_random(cfg, tmp_path)
    written = (directory / "tensors.bin").stat().st_mtime_ns
    assert unpack_random(cfg, tmp_path) == directory  # once per seed and shape
    assert (directory / "tensors.bin").stat().st_mtime_ns == written
    copy = drawn.drawn(tmp_path)
    assert sorted(copy.names) == sorted(drawn.shapes)
    for name in drawn.shapes:
        want, got = drawn.value(name), copy.value(name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_random_weights_of_another_seed_or_shape_are_not_read_from_a_copy(tmp_path):
    from xds_mpi.model.weights import RandomWeights, unpack_random

    cfg = _random_tiny()
    unpack_random(cfg, tmp_path)
    for other in (_random_tiny(seed=cfg.seed + 1), _random_tiny(num_routed_experts=32)):
        assert RandomWeights(other, other.seed).drawn(tmp_path) is None


def test_a_die_built_from_drawn_random_weights_imports_no_generator_and_holds_alike(tmp_path):
    """numpy.random's import and the drawing were ~50 ms of every die's start-up at 64 dies."""
    from xds_mpi.model.weights import unpack_random

    unpack_random(_random_tiny(), tmp_path)
    code = (
        "import dataclasses, sys, zlib\n"
        "from xds_mpi.model.shapes import load_model_preset\n"
        "from xds_mpi.model.weights import build_model\n"
        "cfg = dataclasses.replace(load_model_preset('tiny'), weights='random')\n"
        f"model = build_model(cfg, unpacked_under={str(tmp_path)!r})\n"
        "crc = 0\n"
        "for name in sorted(model.params):\n"
        "    crc = zlib.crc32(model.params[name].tobytes(), crc)\n"
        "print('numpy.random' in sys.modules, len(model.params), crc)\n"
    )
    outputs = []
    for source in (code, code.replace(f"unpacked_under={str(tmp_path)!r}", "")):
        run = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            check=True,
        )
        outputs.append(run.stdout.strip())
    from_copy, drawn_here = outputs
    assert from_copy.startswith("False "), from_copy
    assert drawn_here.startswith("True "), drawn_here  # drawn in the process: its generators
    assert from_copy.split(" ", 1)[1] == drawn_here.split(" ", 1)[1]  # every tensor, every bit
