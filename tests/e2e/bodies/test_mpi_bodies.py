"""Every MPI test body under tests/mpi/body_*.py, at 2, 4 and 8 ranks, and on the RMA path."""

from __future__ import annotations

import re

import pytest
from harness import MPI_DIR, RANK_COUNTS, explain, run_bodies

from xccl.gmem_paths import MEMORY_PATH_ENV

BODIES = sorted(MPI_DIR.glob("body_*.py"))


# Every body runs at 2 and 4 ranks by default; at 8 ranks with --long (the default suite serves
# 8 dies in tests/e2e/serving/test_serving.py and the config matrix).


@pytest.mark.parametrize(
    "num_procs,body",
    [
        pytest.param(
            n,
            body,
            id=f"{n}-{body.stem}",
            marks=pytest.mark.long if n == 8 else (),
        )
        for n in RANK_COUNTS
        for body in BODIES
    ],
)
def test_body(num_procs, body):
    result = run_bodies(num_procs, body, timeout_s=180)
    assert result.returncode == 0, explain(result)
    passed = re.findall(r"(\d+) passed", result.output)
    assert len(passed) == num_procs and all(int(n) > 0 for n in passed), explain(result)


def test_bodies_on_the_rma_path(monkeypatch):
    """The bodies above run on the default memory path (load/store between dies of one node);
    once more, all in one 4-rank job, with every window forced onto RMA (xccl/gmem_paths.py)."""
    monkeypatch.setenv(MEMORY_PATH_ENV, "rma")
    result = run_bodies(4, *BODIES, timeout_s=300)
    assert result.returncode == 0, explain(result)
    passed = re.findall(r"(\d+) passed", result.output)
    assert len(passed) == 4 and all(int(n) > 0 for n in passed), explain(result)
