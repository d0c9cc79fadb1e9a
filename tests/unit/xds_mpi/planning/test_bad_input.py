"""`xds-mpi plan`'s bad input: a clear message and exit code 2, no traceback."""

from __future__ import annotations

import pytest

from launch.cli.main import main

TRACE_ARGS = ["--synthetic", "2000,200", "--rate", "2", "--duration", "5"]


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_budget_below_one_te_is_refused(capsys, tmp_path):
    code, text = run(capsys, *TRACE_ARGS, "--chips", "4", "--out", str(tmp_path))
    assert code == 2
    assert "--chips 4 is 8 dies on ascend910c (2 per chip): below one TE" in text
    assert "Traceback" not in text


def test_an_slo_nothing_meets_names_the_closest_and_by_how_much(capsys, tmp_path):
    code, text = run(
        capsys,
        *TRACE_ARGS,
        "--chips",
        "16",
        "--kinds",
        "colocated",
        "--slo",
        "ttft=1ms,tpot=1ms",
        "--out",
        str(tmp_path),
    )
    assert code == 2
    assert "no deployment meets TTFT <= 0.001 s, TPOT <= 1 ms for any request" in text
    assert "the closest is EP" in text and "x the SLO" in text and "over at its worst" in text


def test_a_workload_no_memory_holds_says_why(capsys, tmp_path):
    code, text = run(
        capsys,
        "--synthetic",
        "150000,2000",
        "--rate",
        "1",
        "--duration",
        "5",
        "--chips",
        "16",
        "--kinds",
        "colocated",
        "--out",
        str(tmp_path),
    )
    assert code == 2
    assert "no deployment in 32 dies holds this workload in memory" in text
    assert "decode die memory: weights" in text


@pytest.mark.parametrize("slo", ["ttft=2s", "ttft=2,tpot=35ms"])
def test_a_malformed_slo_is_refused(capsys, tmp_path, slo):
    code, text = run(capsys, *TRACE_ARGS, "--slo", slo, "--out", str(tmp_path))
    assert code == 2 and "--slo" in text
