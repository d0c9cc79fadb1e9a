import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# tests/harness.py and the other helpers here are imported by name (`from harness import ...`),
# and so are test modules by other test modules in any folder (`from test_serving import
# check_line`, `from test_decode_failover import served`): tests/ and every folder holding test
# modules go on the path, whatever file or folder pytest is given. (tests/unit/ and tests/e2e/
# hold no test module themselves: tests/unit/xds_mpi/ and tests/unit/xccl/ must not shadow the
# packages.)
sys.path[:0] = [
    str(TESTS),
    *sorted({str(p.parent) for p in TESTS.glob("*/**/test_*.py") if "__pycache__" not in p.parts}),
]


def pytest_addoption(parser):
    parser.addoption(
        "--config-matrix",
        choices=("pairwise", "full"),
        default="pairwise",
        help="which accepted configs tests/e2e/serving/test_config_matrix.py serves with --check:"
        " a pairwise cover of the axes (default, ~20 runs) or every accepted "
        "combination (thousands of runs: a nightly-style job)",
    )
    parser.addoption(
        "--failure-matrix",
        action="store_true",
        default=False,
        help="also the failure runs marked failure_matrix: every {stuck, dead} x {early, "
        "mid-run} fault on a colocated die, early, stuck-for-good, transient and trampoline "
        "losses on afd dies, a PD decode die (or pd_afd attention die) lost early or stuck for "
        "good, memory faults with recompute or MTP, expert slots masked on afd dies, a "
        "saturated die (the default suite runs one case of each fault kind and "
        "deployment kind: the failure_cell marker, docs/testing.md)",
    )
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="also the end-to-end runs marked long: more shapes of what the default suite "
        "already serves and checks (afd domain/group/expert shapes, the protocol bodies at 8 "
        "ranks, a hundred seeded random faults, MTP and PD variants, the afd CLI bring-up and "
        "trace, two-host bodies and an afd run across two hosts)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "long: a longer variant, runs with --long")
    config.addinivalue_line("markers", "failure_matrix: a failure case, runs with --failure-matrix")
    config.addinivalue_line(
        "markers",
        "failure_cell(deployment, kind): the default suite's case of one cell of the lean "
        "failure matrix (docs/testing.md); `-m failure_cell` runs the matrix alone",
    )


def pytest_collection_modifyitems(config, items):
    """Keep the default suite lean (CI's budget): the variants marked long / failure_matrix
    repeat a mechanism a default test already covers, at another shape or fault kind."""
    for marker, option in (("long", "--long"), ("failure_matrix", "--failure-matrix")):
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"a {marker} variant: runs with {option}")
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
