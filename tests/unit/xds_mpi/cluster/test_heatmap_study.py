"""The heatmap study's pure parts (xds_mpi/cluster/heatmap_study.py) on crafted numbers with
known answers: the combine over the rates, the sign-stable share, the cell lookup of the file
it makes, the per-cell trace read back by the trace reader."""

from __future__ import annotations

import math

import pytest

from xds_mpi.cluster.heatmap import read_heatmap, write_heatmap
from xds_mpi.cluster.heatmap_study import (
    build_heatmap,
    combine,
    edges,
    gain,
    grid,
    mean_jct,
    sign_stable_share,
    trace_lines,
    write_trace,
)
from xds_mpi.config.trace import TraceConfig
from xds_mpi.workload.trace_replay import TraceLine, read_trace

NAN = math.nan
# cells[k][i][j]: 3 rates x 2 prompts x 2 ratios
CELLS = [
    [[0.5, -0.25], [1.0, 0.0]],
    [[0.25, 0.5], [2.0, 0.0]],
    [[0.125, -1.0], [0.5, 0.0]],
]


def test_combine_sums_the_rates_cell_by_cell():
    assert combine(CELLS) == [[0.875, -0.75], [3.5, 0.0]]


def test_combine_leaves_a_cell_unknown_when_one_rate_failed():
    cells = [[[1.0, NAN]], [[2.0, 3.0]]]
    combined = combine(cells)
    assert combined[0][0] == 3.0 and math.isnan(combined[0][1])


def test_sign_stable_share_counts_cells_of_one_sign_at_every_rate():
    # (0, 0) + + +, (0, 1) - + -, (1, 0) + + +, (1, 1) 0 0 0: three of four keep their sign
    assert sign_stable_share(CELLS) == 0.75


def test_sign_stable_share_skips_cells_with_a_failed_rate():
    cells = [[[1.0, NAN, -1.0]], [[2.0, 5.0, 1.0]]]  # only (0, 0) and (0, 2) are finite
    assert sign_stable_share(cells) == 0.5
    assert math.isnan(sign_stable_share([[[NAN]], [[1.0]]]))


def test_gain_and_mean_jct():
    assert gain(jct_colocated=3.0, jct_pd=2.0) == 0.5
    assert gain(jct_colocated=1.0, jct_pd=2.0) == -0.5
    assert mean_jct([0.0, 1.0, 2.0], [2.0, 2.0, 5.0]) == 2.0
    with pytest.raises(ValueError, match="2 arrivals for 1 finishes"):
        mean_jct([0.0, 1.0], [1.0])


def test_edges_are_geometric_midpoints_and_half_steps_beyond():
    assert edges([1024.0, 4096.0, 16384.0]) == (512.0, 2048.0, 8192.0, 32768.0)
    low, high = edges([64.0])
    assert low == pytest.approx(64 / math.sqrt(2)) and high == pytest.approx(64 * math.sqrt(2))


def test_cell_lookup_of_the_built_heatmap(tmp_path):
    cells = [[[0.1 * (3 * i + j) for j in range(3)] for i in range(3)], [[1.0] * 3] * 3]
    heatmap = build_heatmap([1024, 4096, 16384], [0.0625, 0.25, 1.0], [2.0, 10.0], cells, {})
    assert heatmap.cell_of(1024, 64) == (0, 0)
    assert heatmap.cell_of(5000, 5000) == (1, 2)  # ratio 1
    assert heatmap.cell_of(3000, 750) == (1, 1)  # prompt above the 2048 edge, ratio 0.25
    assert heatmap.cell_of(100, 1) == (0, 0)  # below the grid: the nearest cell
    assert heatmap.cell_of(10**6, 10**7) == (2, 2)  # above it
    assert heatmap.value(16384, 4096) == pytest.approx(0.1 * 7 + 1.0)
    write_heatmap(tmp_path / "h.json", heatmap)
    back = read_heatmap(tmp_path / "h.json")
    assert back == heatmap
    assert back.sign_stable_share == pytest.approx(8 / 9)  # only cell (0, 0): 0 then +1


def test_grid_orders_rate_prompt_ratio_and_refuses_a_bad_axis():
    cells = grid([128, 512], [0.25], [1.0, 4.0])
    assert [(c.rps, c.prompt_len, c.output_len) for c in cells] == [
        (1.0, 128, 32),
        (1.0, 512, 128),
        (4.0, 128, 32),
        (4.0, 512, 128),
    ]
    assert [(c.rps_idx, c.prompt_idx, c.ratio_idx) for c in cells][-1] == (1, 1, 0)
    with pytest.raises(ValueError, match="--prompts must be positive and ascending"):
        grid([512, 128], [0.25], [1.0])


def test_the_cell_trace_reads_back_as_the_batch(tmp_path):
    (cell,) = grid([1100], [0.5], [4.0])
    path = tmp_path / "cell.jsonl"
    write_trace(path, cell, num_requests=3)
    lines = read_trace(TraceConfig(path=str(path)))
    assert all(isinstance(x, TraceLine) for x in lines)
    assert [x.timestamp_s for x in lines] == [0.0, 0.25, 0.5]
    assert {(x.input_len, x.output_len) for x in lines} == {(1100, 550)}
    ids = [i for x in lines for i in x.hash_ids]
    assert len(ids) == 3 * 3 and len(set(ids)) == 9  # ceil(1100 / 512) blocks each, none shared
    assert trace_lines(cell, 1)[0]["hash_ids"] == [0, 1, 2]
