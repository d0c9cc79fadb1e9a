"""Issue 61: the per-chip count follows the hardware profile, and the validation table's rows are
counted by row and by experiment, each recomputed here from the model."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import REPO_ROOT

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.topology import Topology
from xds_mpi.projection.cost import Hardware
from xds_mpi.projection.paper_data import EXPERIMENTS, VALIDATION, Published
from xds_mpi.projection.paper_table import Counts, validation_table
from xds_mpi.projection.project import project

BIG = cost_shape()
WORK = dict(batch_per_die=60, kv_len=3072, mtp_depth=1, accept_rate=0.9)


@pytest.mark.parametrize("profile", ["ascend910c", "h800"])
def test_tokens_per_chip_count_the_profiles_dies_per_chip(profile):
    """An H800 is one die a chip, a 910C package two: tokens/s per chip is the iteration's
    tokens over the iteration over (dies / the profile's dies per chip), whatever the emulated
    pod's layout says (cfg.hardware.dies_per_chip is 2 by default)."""
    cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml", [])
    hw = Hardware.from_profile(load_profile(profile))
    p = project(cfg, BIG, hw, **WORK)
    topo = Topology.from_config(cfg)
    tokens = WORK["batch_per_die"] * topo.num_dp_domains * topo.dp_groups_per_domain * 1.9
    chips = topo.num_dies / hw.dies_per_chip
    assert p.tokens_per_s_per_chip == pytest.approx(tokens / p.iteration_s / chips)
    assert hw.dies_per_chip == {"ascend910c": 2, "h800": 1}[profile]
    doubled = project(cfg, BIG, replace(hw, dies_per_chip=2 * hw.dies_per_chip), **WORK)
    assert doubled.tokens_per_s_per_chip == pytest.approx(2 * p.tokens_per_s_per_chip)


def test_rows_are_counted_by_row_and_by_experiment():
    """Every validation row names its experiment; the counts by experiment are the rows' own
    errors; the measured Figure 22b layer is a row, stream 1's restated balance, the AFD run's
    tokens/s and the dispatch+combine share (calibration and wait rows' arithmetic) are not."""
    table = validation_table()
    n = Counts.of(table)
    valid = [r for r in table if r.role == "validation"]
    assert {r.experiment for r in valid} == set(EXPERIMENTS) == set(n.by_experiment)
    for name, (rows, in10, in15) in n.by_experiment.items():
        mine = [abs(r.error) for r in valid if r.experiment == name]
        assert (rows, in10, in15) == (len(mine), sum(e <= 0.10 for e in mine),
                                      sum(e <= 0.15 for e in mine))  # fmt: skip
    assert sum(rows for rows, _, _ in n.by_experiment.values()) == n.validation
    role = {(p.source, p.metric): p.role for p in VALIDATION}
    assert role["001 Fig. 22b", "layer"] == "validation"
    assert role["001 §4.2.3", "stream 1"] == "derived"
    assert role["000 §7.1 AFD", "tokens/s/chip"] == "derived"
    assert role["000 Fig. 20", "share dispatch+combine"] == "derived"
    with pytest.raises(ValueError, match="experiment"):
        Published(source="x", scenario="x", metric="tpot", value=1.0, unit="ms")
