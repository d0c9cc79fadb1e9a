import sys
from pathlib import Path

# tests/harness.py is imported as `harness` by the test modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption(
        "--config-matrix",
        choices=("pairwise", "full"),
        default="pairwise",
        help="which accepted configs tests/test_config_matrix.py serves with --check:"
        " a pairwise cover of the axes (default, ~20 runs) or every accepted "
        "combination (thousands of runs: a nightly-style job)",
    )
    parser.addoption(
        "--failure-matrix",
        action="store_true",
        default=False,
        help="tests/test_decode_failover.py: every {stuck, dead} x {early, mid-run} fault on a "
        "colocated die (4 serving runs more); tests/test_afd_failover.py: early, stuck-for-good "
        "and trampoline losses on afd dies (4 more)",
    )
