"""`xds-mpi bench load` (launch/bench/load.py): one deployment at several arrival rates on the
virtual clock. The knee rule without MPI, then a tiny sweep end to end: its table, its plot, the
queue growing with the rate and `project`'s ceiling beside the saturation."""

from __future__ import annotations

import csv
import re
import subprocess
import sys

from launch.bench.load import knee


def _row(rate: float, served: float) -> dict:
    return {"rate_per_s": rate, "served_req_s": served}


def test_the_knee_is_the_lowest_rate_served_near_saturation():
    rows = [_row(10, 5.6), _row(20, 6.33), _row(40, 6.65), _row(80, 6.69), _row(160, 6.68)]
    best, rate = knee(rows)
    assert best == 6.69
    assert rate == 40  # 20/s served 6.33 < 0.95 x 6.69 = 6.36; 40/s the first above


def test_a_tiny_sweep_on_the_virtual_clock(tmp_path):
    plot, out = tmp_path / "load.png", tmp_path / "load.csv"
    command = [sys.executable, "-m", "launch.cli.main", "bench", "load", "--rates", "4", "40"]
    command += ["--plot", str(plot), "--out", str(out), "--timeout", "300"]
    for s in ("workload.num_requests=6", "workload.output_len=3", "run.slo_tpot_ms=200"):
        command += ["--set", s]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["rate_per_s"]) for r in rows] == [4.0, 40.0]
    assert all(int(r["requests"]) == 6 for r in rows)
    slow, fast = rows
    # the same seed's arrivals, ten times closer: served sooner (at 6 requests the queue is
    # the wait for the running iteration's end, ~100 ms either way, not monotonic in the rate)
    assert float(fast["span_s"]) < float(slow["span_s"])
    assert float(fast["served_req_s"]) > float(slow["served_req_s"])
    for row in rows:
        assert 0 <= float(row["queue_p50_ms"]) <= float(row["queue_p99_ms"])
        assert 0 < float(row["ttft_p50_ms"]) <= float(row["ttft_p99_ms"])
    line = re.search(r"decode ceiling ([\d.]+) requests/s", done.stdout)
    assert line is not None and float(line.group(1)) > 0, done.stdout
    assert plot.stat().st_size > 10_000
