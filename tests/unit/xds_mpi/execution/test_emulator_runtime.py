"""The emulator's pinning and GC control (xds_mpi/execution/emulator_runtime.py), the bounded
wait every poll uses (xccl/wake.py poll_until) and what `bench serve` reads from a run's trace
(launch/serve/stats.py), on crafted inputs."""

from __future__ import annotations

import gc
import json
import math
import os

import pytest

from launch.serve.stats import first_dispatch_waits, parse_output, summarize
from xds_mpi.config.emulator import EmulatorConfig
from xds_mpi.execution import emulator_runtime


@pytest.fixture
def restore_gc():
    affinity = os.sched_getaffinity(0)
    yield
    gc.enable()
    gc.unfreeze()
    os.sched_setaffinity(0, affinity)


def test_pinning_follows_the_mode(restore_gc):
    cores = sorted(os.sched_getaffinity(0))
    assert emulator_runtime.pin("never", 0, 1) is None
    assert emulator_runtime.pin("auto", 0, len(cores) + 1) is None  # fewer cores than ranks
    assert os.sched_getaffinity(0) == set(cores)
    assert emulator_runtime.pin("always", len(cores) + 1, len(cores) + 2) == cores[1 % len(cores)]
    assert os.sched_getaffinity(0) == {cores[1 % len(cores)]}


def test_controlled_gc_freezes_once_then_collects_every_n(restore_gc):
    cfg = EmulatorConfig(pin_cores="never", gc="controlled", gc_every=3)
    emulator_runtime.start(cfg, local_rank=0, local_size=1)
    assert not gc.isenabled()
    emulator_runtime.between_iterations()  # start-up over: frozen, nothing collected
    assert gc.get_freeze_count() > 0 and emulator_runtime.collections() == 0
    for _ in range(5):  # iterations 2..6: collections at 3 and 6
        emulator_runtime.between_iterations()
    assert emulator_runtime.collections() == 2


def test_default_gc_collects_on_its_own_after_start_up_is_frozen(restore_gc):
    emulator_runtime.start(
        EmulatorConfig(pin_cores="never", gc="default"), local_rank=0, local_size=1
    )
    assert gc.isenabled() and gc.get_freeze_count() == 0
    emulator_runtime.between_iterations()  # start-up over: frozen
    frozen = gc.get_freeze_count()
    assert frozen > 0
    for _ in range(3):
        emulator_runtime.between_iterations()
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    assert emulator_runtime.collections() == 0


def test_poll_until_returns_once_ready_and_times_out_naming_the_wait():
    from xccl.errors import XcclTimeout
    from xccl.wake import poll_until

    tries = iter([False, False, True])
    poll_until(lambda: next(tries), deadline=float("inf"), describe=lambda: "never")
    with pytest.raises(XcclTimeout, match="die 3 waits for die 5"):
        poll_until(lambda: False, deadline=0.0, describe=lambda: "die 3 waits for die 5")


def span(name, ts, dur, tid=1, **args):
    return {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_serve_stats_split_a_crafted_trace(tmp_path):
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "wall clock"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "rank 0 host"}},
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 1,
            "tid": 1,
            "args": {"name": "rank 1 colocated die 0"},
        },
    ]
    # Two iterations of one MoE layer: gate 1 ms, dispatch 4 ms (3 ms waiting), experts 2 ms,
    # combine 3 ms (1 ms waiting); the second iteration's first dispatch waits 5 ms.
    events = []
    for start, wait in ((0, 3000), (20000, 5000)):
        events += [
            span("iteration", start, 15000, iteration=start),
            span("gate", start + 100, 1000, layer=1),
            span("dispatch", start + 1100, wait + 1000, layer=1),
            span("dispatch wait", start + 1200, wait, event=1),
            span("experts", start + 7000, 2000, layer=1),
            span("combine", start + 9000, 3000, layer=1),
            span("combine wait", start + 9100, 1000, event=1),
        ]
    trace = tmp_path / "run.trace.json"
    trace.write_text(json.dumps({"traceEvents": meta + events}))
    (tmp_path / "rank1.json").write_text(json.dumps({"mpi_work_s": 0.0004}))
    output = f"summary: 8 requests served, 128 tokens in 2.00 s = 64.0 tok/s\nINFO trace {trace}"
    assert parse_output(output) == (64.0, trace)
    assert first_dispatch_waits(events) == [3.0, 5.0]
    stats = summarize(output, tmp_path)
    assert stats.moe_layer_ms == pytest.approx((1 + 4 + 2 + 3 + 1 + 6 + 2 + 3) / 2)
    assert stats.wait_ms == pytest.approx((3 + 1 + 5 + 1) / 2)
    assert stats.mpi_ms == pytest.approx(0.2)
    assert stats.python_ms == pytest.approx(stats.moe_layer_ms - stats.wait_ms - 0.2)
    assert stats.iteration_ms == pytest.approx(15.0)
    assert math.isnan(stats.startup_s) and math.isnan(stats.projected_iteration_ms)
    # The start-up and projection lines (ranks/core/ready.py, the TE-shell's projection).
    output += (
        "\nstart-up: all 4 ranks ready in 2.5 s; CPU per rank median 0.61 s, max 0.70 s; "
        "PSS per rank median 48 MiB, max 50 MiB, 0.19 GiB in all"
        "\nprojected on 910C: iteration 62.94 ms, TPOT 62.94 ms"
    )
    stats = summarize(output, tmp_path, wall_s=8.0)
    assert (stats.startup_s, stats.cpu_per_rank_s) == (2.5, 0.61)
    assert (stats.pss_per_rank_mib, stats.pss_total_gib) == (48, 0.19)
    assert stats.projected_iteration_ms == 62.94
    assert stats.serving_s / stats.wall_s == pytest.approx(0.25)
