"""Issue 61 item 4, the wait model's form 2 (xds_mpi/projection/waits.py, docs/projection.md):
a normal body at every call and [000] §4.4's launch straggler once per die per pass, absorbed by
the pass's first dispatch. Each value is recomputed from the model or from seeded draws of the
same form; item 5's counts and the per-GPU print on the H800 profile."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from launch.cli.main import main as cli_main
from xds_mpi.projection.cost import expected_max_z
from xds_mpi.projection.paper_data import EXPERIMENTS
from xds_mpi.projection.paper_table import (
    Counts,
    scenario_inputs,
    slowest_call_of,
    validation_table,
)
from xds_mpi.projection.project import project
from xds_mpi.projection.waits import (
    Tail,
    expected_max_s,
    launch_mean_wait_s,
    launch_s,
    slowest_call_wait_s,
    wait_s,
)

KERNELS = "ascend910c_kernels"  # the profile whose [000] scenarios pay form 2's tail
SIGMA = 22.1 * 1e-6  # the profile's die_jitter_us, as waits.stragglers reads it


def _000(tail_kw: dict | None = None, *, tail: bool = True):
    """The [000] colocated scenario on KERNELS, its tail changed by `tail_kw` or removed."""
    cfg, m, hw, kwargs = scenario_inputs("000 colocated", KERNELS)
    if not tail:
        hw = replace(hw, tail=None)
    elif tail_kw:
        hw = replace(hw, tail=replace(hw.tail, **tail_kw))
    return cfg, m, hw, kwargs, project(cfg, m, hw, **kwargs)


def _max_over_min(kind: str, tail_kw: dict | None = None, *, tail: bool = True) -> float:
    """Figure 20's max / min as the table prices it: the slowest call over the waitless one."""
    cfg, m, hw, kwargs, p = _000(tail_kw, tail=tail)
    return slowest_call_of(p, cfg, m, hw, kwargs, kind) / (
        p.primitives_s[f"{kind} intrinsic"] * 1e6
    )


def test_the_profile_takes_form_2():
    _, _, hw, _, _ = _000()
    assert hw.tail == Tail(p=0.01, min_s=SIGMA, alpha=1.5, per="pass")


@pytest.mark.parametrize("heavier", [dict(p=0.05), dict(alpha=1.2), dict(min_s=2 * SIGMA)])
def test_a_heavier_tail_gives_dispatch_a_larger_max_over_min_and_leaves_combine(heavier):
    """Form 2's tail lands on a pass's first dispatch: a more frequent, heavier or larger one
    raises dispatch's max / min over the body's; combine's is the body's whatever the tail
    (form 1, the tail at every call, raises both)."""
    body = _max_over_min("dispatch", tail=False)
    assert _max_over_min("dispatch", heavier) > _max_over_min("dispatch") > body
    combine = _max_over_min("combine", tail=False)
    assert _max_over_min("combine", heavier) == pytest.approx(combine, rel=1e-12)
    per_call = _max_over_min("combine", {**heavier, "per": "call"})
    assert per_call > 2 * combine


def test_the_expected_maximum_grows_with_the_draws():
    """E[max of N starts] rises with N, with and without the tail, and the slowest call of k
    iterations with k (the window Figure 20's maxima were taken over is not published)."""
    tail = Tail(p=0.01, min_s=SIGMA, alpha=1.5, per="pass")
    for t in (None, tail):
        seq = [expected_max_s(SIGMA, t, n) for n in (10, 100, 1_000, 10_000, 100_000)]
        assert all(b > a for a, b in zip(seq, seq[1:]))
    seq = [slowest_call_wait_s(SIGMA, tail, 288, 59, passes=2, iterations=k) for k in (1, 10, 100)]
    assert all(b > 1.5 * a for a, b in zip(seq, seq[1:]))  # the tail's growth, not the body's
    assert expected_max_s(SIGMA, None, 1000) == pytest.approx(SIGMA * expected_max_z(1000))


def test_form_2_agrees_with_seeded_draws_of_the_same_form():
    """Draw the form itself: 288 dies, 59 calls an iteration, two passes whose first calls carry
    the launch delay L (p, Pareto). The mean wait of a call (max start - the die's own, averaged
    over dies and calls) and the slowest call's wait (its latest start - its earliest) agree
    with the model's closed forms (alpha 2.5 here: a finite variance, so draws settle)."""
    rng = np.random.default_rng(61)
    tail = Tail(p=0.02, min_s=SIGMA, alpha=2.5, per="pass")
    dies, calls, firsts, iters = 288, 59, (0, 1), 600
    x = rng.normal(0.0, SIGMA, (iters, calls, dies))
    late = rng.random((iters, len(firsts), dies)) < tail.p
    pareto = tail.min_s * (1 - rng.random((iters, len(firsts), dies))) ** (-1 / tail.alpha)
    x[:, list(firsts), :] += late * pareto
    mean_wait = (x.max(axis=2, keepdims=True) - x).mean()
    model_mean = wait_s(SIGMA, tail, dies) + launch_mean_wait_s(SIGMA, tail, dies) * 2 / calls
    assert model_mean == pytest.approx(mean_wait, rel=0.03)
    slowest = (x.max(axis=2) - x.min(axis=2)).max(axis=1).mean()
    model_slowest = slowest_call_wait_s(SIGMA, tail, dies, calls, passes=2)
    assert model_slowest == pytest.approx(slowest, rel=0.10)
    # the pass's critical path: its first dispatch finishes E[max (G + L)] - E[max G] later
    # (more first dispatches drawn than one run above holds: the max's spread is wide)
    g = rng.normal(0.0, SIGMA, (20_000, dies))
    late = rng.random(g.shape) < tail.p
    first = g + late * tail.min_s * (1 - rng.random(g.shape)) ** (-1 / tail.alpha)
    gained = first.max(axis=1).mean() - g.max(axis=1).mean()
    assert launch_s(SIGMA, tail, dies) == pytest.approx(gained, rel=0.03)


def test_the_tail_moves_the_iteration_by_one_launch_straggler_a_pass():
    """The iteration (so TPOT) grows by launch_s x passes, no more: the per-call costs stay the
    body's; a call's mean wait grows by the first dispatch's extra spread over the calls."""
    cfg, m, hw, kwargs, p = _000()
    *_, body = _000(tail=False)
    dies, passes, calls = 288, 1 + kwargs["mtp_depth"], 58 + kwargs["mtp_depth"]
    launch = launch_s(hw.jitter_s, hw.tail, dies)
    assert launch > 0
    assert p.iteration_s - body.iteration_s == pytest.approx(launch * passes, rel=1e-9)
    assert p.breakdown_s["launch stragglers"] + p.breakdown_s["MTP launch stragglers"] == (
        pytest.approx(launch * passes)
    )
    extra = launch_mean_wait_s(hw.jitter_s, hw.tail, dies) * passes / calls
    got = p.primitives_s["dispatch wait"] - body.primitives_s["dispatch wait"]
    assert got == pytest.approx(extra, rel=1e-9)
    assert p.primitives_s["combine wait"] == body.primitives_s["combine wait"]
    assert p.primitives_s["dispatch"] == body.primitives_s["dispatch"]


def test_the_independent_rows_and_experiments_are_counted_on_both_profiles():
    """22 independent validation rows in 6 experiment groups on either 910C profile, each
    group's counts the rows' own errors."""
    for profile in ("ascend910c", KERNELS):
        table = validation_table(profile)
        n = Counts.of(table)
        valid = [r for r in table if r.role == "validation"]
        assert n.validation == len(valid) == 22
        assert len(n.by_experiment) == len(EXPERIMENTS) == 6
        assert n.within_10 == sum(abs(r.error) <= 0.10 for r in valid)


def test_h800_prints_tokens_per_gpu(capsys):
    """On the H800 profile `xds-mpi project` prints tokens/s per GPU, the iteration's tokens over
    the GPUs (one die each), not over pairs of dies."""
    assert cli_main(["project", "ep288", "--set", "hardware.profile=h800"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("iteration "))
    iteration_ms = float(line.split()[1])
    per_gpu = float(line.split(", ")[2].split()[0])
    assert line.endswith("tokens/s per GPU")
    assert per_gpu == pytest.approx(60 * 288 * 1.9 / (iteration_ms * 1e-3) / 288, rel=2e-3)
