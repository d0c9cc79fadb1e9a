"""A die of a PD run's afd decode side lost (xds_mpi/plan/failures/checks.py
`_check_pd_afd_loss`): an attention die dead or stuck for good whose DP domain keeps another runs;
every other such row is refused before launch naming what would have to be built.

configs/pd_afd.yaml in one DP domain: JE 0, decode TE-shell 1, attention dies 2-3, expert dies
4-5, prefill die 6."""

from __future__ import annotations

import pytest

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology

ONE_DOMAIN = [
    "deployment.num_dp_domains=1",
    "deployment.dp_groups_per_domain=2",
    "health.timeout_s=4",
    "health.probe_timeout_s=12",
]


def _check(rows: str, *sets: str) -> None:
    cfg = load_config("configs/pd_afd.yaml", [*ONE_DOMAIN, *sets, f"faults.events=[{rows}]"])
    check_failures(cfg, Topology.from_config(cfg))


@pytest.mark.parametrize(
    "row", ["{kind: dead, die: 2, iteration: 0}", "{kind: stuck, die: 3, iteration: 2}"]
)
def test_an_attention_die_dead_or_stuck_for_good_is_accepted(row):
    _check(row)


@pytest.mark.parametrize(
    "rows, sets, words",
    [
        (
            "{kind: dead, die: 4, iteration: 1}",
            [],
            r"losing expert die 4 of a PD run's afd decode side is not built: its experts live "
            "on it alone",
        ),
        (
            "{kind: stuck, die: 5, iteration: 1}",
            [],
            "losing expert die 5",
        ),
        (
            "{kind: stuck, die: 2, iteration: 1, duration_s: 2}",
            [],
            r"stuck for duration_s\(2.0\) is not built, as for a colocated PD decode die",
        ),
        (
            "{kind: dead, die: 2, iteration: 1}",
            ["deployment.num_host_ranks=1"],
            r"num_host_ranks\(1\) gives the JE the decode balancing",
        ),
        (
            "{kind: dead, die: 2, iteration: 1}",
            ["health.probe_timeout_s=5"],
            r"probe_timeout_s\(5\) must exceed detection and release \(8.2 s\)",
        ),
        (
            "{kind: dead, die: 2, iteration: 1}, {kind: link, die: 6, peer: 3, iteration: 1}",
            [],
            r"with other fault rows \(faults.events\[1\]\)",
        ),
        (
            "{kind: dead, die: 2, iteration: 1}",
            ["deployment.num_dp_domains=2", "deployment.dp_groups_per_domain=1"],
            "attention die 2 is the only die of DP domain 0 .* losing a whole domain",
        ),
    ],
)
def test_pd_afd_losses_that_do_not_run_are_refused_naming_why(rows, sets, words):
    with pytest.raises(ConfigError, match=words):
        _check(rows, *sets)
