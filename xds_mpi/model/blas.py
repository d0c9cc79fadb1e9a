"""One BLAS thread per process: every rank of a job shares the machine's cores, the tiny model's
matrices are far too small to gain from threads (measured: 2 threads made the reference 6x
slower on 2 cores), and OpenBLAS splits a product's rows among its threads, which moves the last
bits of a row with the batch's row count (tests/unit/xds_mpi/model/test_model_layers.py).

`OPENBLAS_NUM_THREADS=1` in the environment does it before numpy loads (the launcher sets it for
the ranks, launch/job/mpiexec.py); `single_thread()` does it in a process that imported numpy first
(pytest, the CLI's check), through the loaded OpenBLAS's own setter. numpy builds on another BLAS
keep their threads; their batch invariance is what the tests measure.
"""

from __future__ import annotations

import ctypes

_SETTERS = (
    "scipy_openblas_set_num_threads64_",  # numpy >= 2 wheels (scipy-openblas, ILP64)
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def _loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process (numpy must be imported)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
    except OSError:  # not Linux
        return []


def single_thread() -> bool:
    """Set the loaded OpenBLAS to one thread; False when no OpenBLAS setter was found."""
    import numpy  # noqa: F401  (loads the BLAS library)

    for path in _loaded_openblas():
        lib = ctypes.CDLL(path)
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(1))
                return True
    return False
