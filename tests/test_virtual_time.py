"""Virtual-time serving (run.clock virtual): the TE-shell's decisions at virtual arrivals from
the state then (xds_mpi/vtime/admission.py, driven without MPI)."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest

from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.engine.balancer import DecodeBalancer
from xds_mpi.engine.requests import Request
from xds_mpi.plan.clock import serving_clock
from xds_mpi.vtime.admission import Completions, decide, from_words, may_start, to_word
from xds_mpi.vtime.results import VirtualTimes


def _requests(*arrivals: float) -> deque:
    return deque(
        Request(req_id=i, prompt=(1, 2, 3), max_new_tokens=4, arrival_s=a)
        for i, a in enumerate(arrivals)
    )


def _balancer(groups=(1, 2), max_batch=1) -> DecodeBalancer:
    return DecodeBalancer(
        groups, max_batch=max_batch, kv_capacity_tokens=4096, block_tokens=16, mtp_depth=0
    )


# -- the rules, without MPI -----------------------------------------------------------------------
def test_idle_dies_warp_to_the_next_arrival_and_the_horizon_is_the_one_after():
    queue, balancer = _requests(3600.0, 3600.0, 7200.0), _balancer(max_batch=8)
    grant = decide(queue, balancer, Completions(), now_s=None, after_s=0.0, idle_s=0.5)
    assert grant.warp_s == 3600.0  # every die idle: no wall time spent on the hour
    assert [(d.req.req_id, d.vtime_s) for d in grant.decisions] == [(0, 3600.0), (1, 3600.0)]
    assert grant.horizon_s == 7200.0 and [r.req_id for r in queue] == [2]


def test_busy_dies_decide_only_what_arrived_before_their_common_start():
    queue, balancer = _requests(0.0, 0.25, 0.5), _balancer(max_batch=8)
    grant = decide(queue, balancer, Completions(), now_s=0.3, after_s=0.0)
    assert [d.vtime_s for d in grant.decisions] == [0.0, 0.25]
    assert grant.horizon_s == 0.5 and grant.warp_s == -math.inf
    assert may_start(0.49, grant.horizon_s) and not may_start(0.5, grant.horizon_s)


def test_a_full_balancer_decides_at_the_finish_that_frees_a_slot_not_before():
    queue, balancer = _requests(0.0, 0.0, 0.0, 0.1, 0.5), _balancer()
    first = decide(queue, balancer, Completions(), now_s=None, after_s=0.0)
    assert [(d.group, d.vtime_s) for d in first.decisions] == [(1, 0.0), (2, 0.0)]
    # Blocked: the dies may run one more iteration (a finish may free a slot at its end).
    assert first.horizon_s == math.nextafter(0.0, math.inf)
    done = Completions()
    done.add(0, 0.3)  # group 1's request finishes at 0.3, group 2's at 0.2
    done.add(1, 0.2)
    second = decide(queue, balancer, done, now_s=0.3, after_s=0.0)
    # Request 2 takes the slot group 2 frees at 0.2; request 3 (arrived at 0.1) waits for the
    # next one, group 1's at 0.3; request 4 arrives after the dies' start.
    assert [(d.req.req_id, d.group, d.vtime_s) for d in second.decisions] == [
        (2, 2, 0.2),
        (3, 1, 0.3),
    ]
    assert second.horizon_s == 0.5 and len(done) == 0


def test_the_balancer_sees_the_state_at_the_arrival_not_the_finishes_reported_later():
    queue, balancer = _requests(0.0, 0.1), _balancer(max_batch=8)
    decide(queue, balancer, Completions(), now_s=0.0, after_s=0.0)  # request 0 -> group 1
    done = Completions()
    done.add(0, 0.2)  # reported by now, but at 0.1 request 0 still held group 1
    grant = decide(queue, balancer, done, now_s=0.3, after_s=0.0)
    assert [(d.group, d.vtime_s) for d in grant.decisions] == [(2, 0.1)]
    assert len(done) == 1  # not applied yet: its virtual time has not come for any decision


def test_virtual_times_travel_in_agreement_words_bit_for_bit():
    times = [0.0, 1e-9, 0.1 + 0.2, 3600.000000123, math.inf]
    words = np.array([to_word(t) for t in times])
    assert list(from_words(words)) == times
    assert list(np.argsort(words)) == list(range(len(times)))  # ordered as the times
    with pytest.raises(ValueError, match="must be >= 0"):
        to_word(-1.0)


def test_a_request_s_metrics_on_the_virtual_clock():
    t = VirtualTimes(
        req_id=0,
        arrival_s=1.0,
        decided_s=1.5,
        admitted_s=2.0,
        first_token_s=2.25,
        finish_s=3.25,
        num_tokens=5,
    )
    assert (t.queue_s, t.ttft_s, t.tpot_s, t.e2e_s) == (1.0, 1.25, 0.25, 2.25)


def test_virtual_is_the_colocated_run_s_default_and_refused_where_not_built():
    def clock(config, *sets):
        return serving_clock(load_config(f"configs/{config}.yaml", list(sets)))

    assert clock("colocated").kind == "virtual"
    assert clock("colocated", "run.clock=wall").kind == "wall"
    serve_clock = clock("colocated", "serve.enabled=true")
    assert serve_clock.kind == "wall" and "xds-mpi serve" in serve_clock.why
    assert clock("afd").kind == "wall" and clock("pd").kind == "wall"
    for config, sets, named in (
        ("pd", [], "pd.enabled"),
        ("afd", [], "deployment.kind(afd)"),
        ("colocated", ["serve.enabled=true"], "serve.enabled"),
    ):
        with pytest.raises(ConfigError, match=r"run\.clock\(virtual\)") as refused:
            clock(config, "run.clock=virtual", *sets)
        assert named in str(refused.value)
