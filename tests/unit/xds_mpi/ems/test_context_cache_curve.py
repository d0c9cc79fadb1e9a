"""The projected context-caching curve (xds_mpi/ems/context_cache_curve.py) against its own
parts: what a reuse rate pulls and computes, the planes' order, and the CLI's validation table
against [001] §5.4.3 (docs/trace.md)."""

from __future__ import annotations

import pytest

from launch.cli.main import main
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config
from xds_mpi.ems.context_cache_curve import (
    PROMPT_TOKENS,
    PROMPTS_PER_DIE,
    REUSE_RATES,
    cache_curve,
    cached_prefix,
    planes,
    validation_rows,
)
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.kv_memory import projected_kv_bytes
from xds_mpi.projection.paper_data import CONTEXT_CACHING
from xds_mpi.results.request_pricing import causal_chunks


@pytest.fixture(scope="module")
def points():
    return {(p.plane, p.reuse): p for p in cache_curve(Config())}


def test_a_cached_prefix_is_read_not_computed():
    for cached in (0, 512, 1000, 3686, 4095):
        chunks = causal_chunks(PROMPT_TOKENS, cached)
        assert sum(rows for _, rows in chunks) == PROMPT_TOKENS - cached
        assert chunks[-1][0] == PROMPT_TOKENS  # the last rows read the whole KV
        assert all(kv - rows >= cached for kv, rows in chunks)  # and none recomputes the prefix


def test_the_cached_prefix_is_whole_ems_blocks():
    """[001] §4.4.2's blocks (128-512 tokens): the rates on a block boundary keep their tokens,
    90 % of 4K (3,686) keeps 28 blocks of 128 (and 7 of 512 would keep the same)."""
    assert [cached_prefix(r) for r in REUSE_RATES] == [0, 512, 1024, 2048, 3072, 3584]
    assert 3686 // 512 * 512 == 3584


def test_the_pull_is_the_cached_kv_over_the_plane(points):
    plane = planes(load_profile("ascend910c"))
    for reuse in REUSE_RATES:
        cached = cached_prefix(reuse)
        nbytes = PROMPTS_PER_DIE * projected_kv_bytes(cached, cost_shape())
        for name in ("UB", "VPC"):
            expected = plane[name].latency_s + nbytes / plane[name].bytes_per_s if cached else 0.0
            assert points[(name, reuse)].pull_s == pytest.approx(expected)
    # [001] Table 1's read (164 GB/s) against 400 Gbps per node over 16 dies
    assert plane["UB"].bytes_per_s / plane["VPC"].bytes_per_s == pytest.approx(164 / 3.125)


def test_more_reuse_is_faster_and_ub_beats_vpc(points):
    for name in ("UB", "VPC"):
        ttft = [points[(name, r)].ttft_s for r in REUSE_RATES]
        assert ttft == sorted(ttft, reverse=True) and len(set(ttft)) == len(ttft)
    assert points[("UB", 0.0)].ttft_s == points[("VPC", 0.0)].ttft_s  # nothing pulled
    for reuse in REUSE_RATES[1:]:
        assert points[("UB", reuse)].ttft_s < points[("VPC", reuse)].ttft_s
        assert points[("UB", reuse)].compute_s == points[("VPC", reuse)].compute_s


def test_the_validation_table(points, capsys):
    rows = validation_rows(list(points.values()))
    assert [(what, published) for what, published, _ in rows] == list(CONTEXT_CACHING)
    ub = {r: points[("UB", r)] for r in REUSE_RATES}
    assert rows[2][2] == pytest.approx(1 - ub[0.5].ttft_s / ub[0.0].ttft_s)
    assert main(["project", "--context-cache"]) == 0
    out = capsys.readouterr().out
    assert "[001] §5.4.3" in out and "TTFT reduction at reuse 90 %" in out
    assert len([line for line in out.splitlines() if line.startswith(("UB ", "VPC "))]) == 12
