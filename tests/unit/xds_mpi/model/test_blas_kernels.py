"""Batch invariance on every BLAS kernel family this CPU can run, not only the one OpenBLAS
picks for it: the matmul and reference tests again, each in a process whose OpenBLAS is forced
onto one family with OPENBLAS_CORETYPE (xds_mpi/model/layers.py says why the invariance holds).
A family whose instructions the CPU lacks skips with the reason."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy  # noqa: F401  (maps its BLAS library into the process, which _openblas_core reads)
import pytest

from xds_mpi.model import blas

REPO = Path(__file__).resolve().parents[4]
# family -> the CPU flags (/proc/cpuinfo) its kernels need
FAMILIES = {
    "Haswell": {"avx2", "fma"},
    "Zen": {"avx2", "fma"},
    "SkylakeX": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"},
    "Cooperlake": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"},
    "SapphireRapids": {
        *("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"),
        *("avx512_fp16", "amx_tile", "amx_bf16"),
    },
}
# A family an OpenBLAS build has no kernels of its own for runs its nearest one's; this is the
# name the library then reports (the numpy wheels' builds: Zen -> Haswell; Cooperlake and
# SapphireRapids -> SkylakeX).
REPORTED_AS = {"Zen": {"Zen", "Haswell"}, "Cooperlake": {"Cooperlake", "SkylakeX"}}
REPORTED_AS["SapphireRapids"] = {"SapphireRapids", "Cooperlake", "SkylakeX"}
TESTS = [
    "tests/unit/xds_mpi/model/test_model_layers.py",
    "tests/unit/xds_mpi/model/test_model_reference.py::test_batched_decode_equals_each_request_alone",
    "tests/e2e/pd/test_prefill_tp.py",
]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split()[2:]) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


def _openblas_core() -> str | None:
    """The kernel family the loaded OpenBLAS runs, or None when the BLAS is not OpenBLAS."""
    for path in blas._loaded_openblas():
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_corename64_", "openblas_get_corename"):
            getter = getattr(lib, name, None)
            if getter is not None:
                getter.restype = ctypes.c_char_p
                return getter().decode()
    return None


def _forced_env(family: str) -> dict[str, str]:
    return {**os.environ, "OPENBLAS_CORETYPE": family, "OPENBLAS_NUM_THREADS": "1"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_invariance_under_every_kernel_family(family):
    if _openblas_core() is None:
        pytest.skip("numpy's BLAS is not OpenBLAS: OPENBLAS_CORETYPE cannot choose its kernels")
    missing = FAMILIES[family] - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run {family}'s kernels (no {', '.join(sorted(missing))})")
    core = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tests.unit.xds_mpi.model.test_blas_kernels import _openblas_core as c;"
            " print(c())",
        ],
        cwd=REPO,
        env=_forced_env(family),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert core in REPORTED_AS.get(family, {family}), f"forced {family}, OpenBLAS runs {core}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=REPO,
        env=_forced_env(family),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, (
        f"under {family} ({core}):\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
    )
