"""`xds-mpi project --sweep`: each printed row is the projection of that value (recomputed here
from `project`), the plot is written, and bad sweeps are refused before any projection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO_ROOT

from launch.project.sweep import Sweep
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.model.shapes import load_model_preset
from xds_mpi.projection.cost import Hardware
from xds_mpi.projection.imbalance import Imbalance
from xds_mpi.projection.project import Execution, project

XDS_MPI = Path(sys.executable).parent / "xds-mpi"


def _sweep(tmp_path, capsys, text: str) -> list[list[str]]:
    from launch.cli.main import main

    plot = tmp_path / "s.png"
    assert main(["project", "ep288", "--sweep", text, "--sweep-plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert plot.stat().st_size > 1000 and f"plot: {plot}" in out
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("---")) + 1
    return [ln.split() for ln in lines[start:] if ln and not ln.startswith("plot:")]


@pytest.mark.parametrize(
    "text, change",
    [
        ("batch=32,96", lambda v: ({}, dict(batch_per_die=v), {})),
        ("accept=0.5,0.9", lambda v: ({}, dict(accept_rate=v), {})),
        ("ep=64,288", lambda v: ({"deployment.dp_groups_per_domain": v}, {}, {})),
        ("skew=1.5,2", lambda v: ({}, {}, dict(moe=v))),
        ("profile=h800", lambda v: ({}, {}, {})),
    ],
)
def test_each_row_is_the_projection_of_its_value(tmp_path, capsys, text, change):
    rows = _sweep(tmp_path, capsys, text)
    key, values = Sweep.parse(text).key, Sweep.parse(text).values
    assert [r[0] for r in rows] == [str(v) for v in values]
    m = load_model_preset("deepseek_v3")
    for value, row in zip(values, rows, strict=True):
        sets, work, imbalance = change(value)
        cfg = load_config(REPO_ROOT / "configs" / "ep288.yaml",
                          [f"{k}={v}" for k, v in sets.items()])  # fmt: skip
        hw = Hardware.from_profile(load_profile(value if key == "profile" else "ascend910c"))
        kwargs = dict(
            batch_per_die=60,
            kv_len=3072,
            mtp_depth=1,
            accept_rate=0.9,
            execution=Execution(),
            imbalance=Imbalance(noise=True, **imbalance),
        )
        p = project(cfg, m, hw, **{**kwargs, **work})  # fmt: skip
        assert row[1:4] == [
            f"{p.iteration_s * 1e3:.2f}",
            f"{p.tpot_s * 1e3:.2f}",
            f"{p.tokens_per_s_per_chip:.0f}",
        ]


@pytest.mark.parametrize(
    "text, words",
    [
        ("tpot=1,2", "KEY one of"),
        ("batch", "KEY=V1,V2"),
        ("batch=0,4", ">= 1"),
        ("accept=0.5,1.2", "in [0, 1]"),
        ("ep=a,b", "ints"),
        ("skew=0.5", ">= 1"),
    ],
)
def test_bad_sweeps_are_refused_with_their_numbers(text, words):
    """Refused while parsing, before any projection; the CLI prints the message and exits 2."""
    with pytest.raises(ConfigError, match=r".*" + words.replace("[", r"\[").replace("]", r"\]")):
        Sweep.parse(text)


def test_the_cli_refuses_a_bad_sweep_with_exit_2():
    out = subprocess.run(
        [str(XDS_MPI), "project", "ep288", "--sweep", "tpot=1"], capture_output=True, text=True,
        timeout=600, cwd=REPO_ROOT,
    )  # fmt: skip
    assert out.returncode == 2 and "--sweep takes KEY=V1,V2" in out.stderr
