"""`xds-mpi project --scaling` (no MPI): the five steps per path match `scale_out`, the fork's
fan-out rows and the source's TPOT are printed, and [001] Table 2's rows carry the published
numbers and the model's errors; a bad count is refused with its number."""

from __future__ import annotations

import re
from dataclasses import replace

from launch.cli.main import main
from xds_mpi.config.schema import config_from_dict
from xds_mpi.scaling.steps import STEP_NAMES, scale_out
from xds_mpi.scaling.validation import validate


def table_row(text: str, first_cell: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(first_cell + " "))
    return re.split(r"\s{2,}", line.strip())


def test_project_scaling_prints_the_steps_fork_and_table2(capsys):
    assert main(["project", "--scaling", "--new-tes", "8", "--dies", "32"]) == 0
    text = capsys.readouterr().out
    header = table_row(text, "as configured")
    assert header[1:] == [*STEP_NAMES, "total"]
    cfg = config_from_dict({})
    for path in ("fork", "dram", "cold", "ems"):
        one = replace(cfg, scaling=replace(cfg.scaling, path=path))
        expected = scale_out(one, num_dies=32, num_new_tes=8)
        row = table_row(text, path)  # the first table: as configured
        assert row[1:] == [f"{s:.2f}" for _, s in expected.steps] + [f"{expected.total_s:.2f}"]
    fork = replace(cfg, scaling=replace(cfg.scaling, path="fork"))
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("fork to TEs")) + 2
    fork_rows = [re.split(r"\s{2,}", ln.strip()) for ln in lines[start : start + 3]]
    assert fork_rows == [
        [str(n)]
        + [f"{scale_out(fork, num_dies=32, num_new_tes=n, fanout=k).load.seconds:.3f}"
           for k in (1, n)]
        for n in (1, 8, 32)
    ]  # fmt: skip
    before, during = map(
        float, re.search(r"TPOT ([\d.]+) ms before .* ([\d.]+) ms during", text).groups()
    )
    assert before < during < 1.2 * before
    for v in validate(cfg):
        row = table_row(text, v.row.what)
        assert row[1:4] == [f"{v.row.published_s:g}", f"{v.projected_s:.1f}", f"{v.error:+.1%}"]


def test_project_scaling_one_path(capsys):
    assert main(["project", "--scaling", "--path", "ems", "--new-tes", "2"]) == 0
    text = capsys.readouterr().out
    assert table_row(text, "ems") and "fork to TEs" not in text
    assert not any(ln.startswith(("fork ", "dram ", "cold ")) for ln in text.splitlines())


def test_project_scaling_refuses_zero_tes(capsys):
    assert main(["project", "--scaling", "--new-tes", "0"]) == 2
    assert "need --new-tes >= 1 and --dies >= 1; got 0, 32" in capsys.readouterr().err
