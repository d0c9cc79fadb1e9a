"""The soak's short version: `xds-mpi bench soak` with its fault schedule (two dies lost, two
flaps, transient faults throughout) and records and trace capped small so that both caps act
within the minute. Its rows are placed early (`--iterations-per-s 3`: in the warm-up on this
machine, 10-30 iterations a second), so the 45 s measured after warm-up is serving on the two
survivors with transient faults, and what it measures is growth with requests, not the ~1-2
MiB a failover's rebuild adds once. Every reply whole or refused with a retryable status, every
request checked (those let go while serving too), 0 mismatches, no process left, the two lost
dies found, and each rank's RSS after warm-up and at the end within RSS_GROWTH_MIB: without the
trace cap (`--trace-max-events 0`) a die grew ~11 KB a request."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RSS_GROWTH_MIB = 3.0  # per rank, from warm-up to the end


@pytest.mark.timeout(420)
def test_a_short_soak_under_faults_keeps_memory_flat(tmp_path):
    argv = [sys.executable, "-m", "launch.cli", "bench", "soak", "--minutes", "0.75"]
    argv += ["--warmup-s", "30", "--streams", "8", "--max-records", "100"]
    argv += ["--trace-max-events", "2000", "--sample-s", "3", "--dir", str(tmp_path)]
    argv += ["--iterations-per-s", "3", "--timeout", "300"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    soak = json.loads((tmp_path / "soak.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    replies = soak["requests"]
    assert set(replies) <= {"ok", "http_429", "http_503"}, replies
    assert soak["errors"] == 0 and replies["ok"] > 100
    assert soak["checked"] == replies["ok"] and soak["mismatches"] == 0
    assert soak["records_dropped"] >= 100  # the cap acted; those were checked as they went
    assert sum("detected after" in line for line in soak["failures"]) == 2  # the two lost
    assert soak["faults_injected"] > 0
    assert soak["left"] == []
    growth = {
        rank: soak["rss_end"][rank] - start
        for rank, start in soak["rss_start"].items()
        if not math.isnan(soak["rss_end"].get(rank, math.nan))
    }
    assert len(growth) == 5, soak["rss_end"]
    assert max(growth.values()) < RSS_GROWTH_MIB, growth
