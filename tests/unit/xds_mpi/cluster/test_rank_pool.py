"""The pool of ranks (xds_mpi/cluster/pool.py) and the autoscaler over it, on crafted loads with
known answers: two pool TEs of different shapes (2 and 4 dies) share 4 pool ranks, so only one
serves at a time; the autoscaler passes over the 4-die TE while 2 ranks are held (a skip) or puts
the scale-out off when none fits (a wait); a drained pool TE's ranks are free from the first
decision after its last finish and serve the other shape next; a pool TE's TE-Pre-Load is its
communication domain formed."""

from __future__ import annotations

import math

import pytest

from xds_mpi.cluster.autoscaler import Autoscaler, scale_out_steps
from xds_mpi.cluster.pool import INF, PoolTurn, RankPool, ReleaseGate, pool_rows
from xds_mpi.config.autoscaler import AutoscalerConfig
from xds_mpi.config.schema import load_config
from xds_mpi.plan.deployment import DeploymentPlan

POOL = (10, 11, 12, 13)  # world ranks after the TEs


def test_it_hands_out_the_lowest_free_ranks_and_takes_them_back():
    pool = RankPool(POOL, {1: 2, 2: 4})
    assert pool.can_take(1) and pool.can_take(2) and pool.can_take(0)  # TE 0: not of the pool
    assert pool.take(1, 3.0) == (10, 11)
    assert not pool.can_take(2)  # 2 free, 4 needed
    pool.give_back(1, 7.5)
    assert pool.take_released() == [PoolTurn(te=1, ranks=(10, 11), taken_s=3.0, given_back_s=7.5)]
    assert pool.take_released() == []
    assert pool.take(2, 8.0) == (10, 11, 12, 13)
    assert pool.turns[-1] == PoolTurn(te=2, ranks=POOL, taken_s=8.0, given_back_s=INF)


def test_taking_more_than_is_free_names_the_te_and_the_counts():
    pool = RankPool(POOL, {1: 2, 2: 4})
    pool.take(1, 0.0)
    with pytest.raises(ValueError, match=r"TE 2 takes 4 ranks at 1 s but 2 are free"):
        pool.take(2, 1.0)


def scaler(pool_tes: dict[int, int], standby: set[int]) -> Autoscaler:
    cfg = AutoscalerConfig(
        enabled=True,
        window_s=0.1,
        scale_out_above=2.0,
        scale_in_below=1.0,
        cooldown_s=1.0,
        scale_out_s=0.5,
    )
    dies = [2] + [pool_tes.get(te, 2) for te in range(1, 1 + len(standby))]
    return Autoscaler(
        cfg,
        dies,
        standby=standby,
        planner=[(("load", 0.5),)] * len(dies),
        pool=RankPool(POOL, pool_tes),
    )


def test_two_shapes_share_the_pool_and_a_drained_te_s_ranks_serve_the_other_shape():
    s = scaler({1: 2, 2: 4}, standby={1, 2})
    out = s.observe(0.0, [9, 0, 0])
    assert (out.kind, out.te, out.pool_ranks) == ("out", 1, (10, 11))
    # TE 2 needs 4 ranks, 2 are free: put off (a wait), not an error
    assert s.observe(2.0, [9, 9, 0]) is None
    assert (s.pool.num_waits, s.pool.num_skips) == (1, 0)
    drain = s.observe(4.0, [2, 1, 0])  # 3 / 4 dies: below 1; TE 1 the least loaded
    assert (drain.kind, drain.te) == ("in", 1)
    s.drained(1)  # its last finish, before the next decision
    assert s.pool.free == [12, 13]  # given back at the next decision, not before
    out = s.observe(6.0, [9, 0, 0])
    assert s.pool.turns[0].given_back_s == 6.0
    # TE 1 served since TE 2 last did: TE 2 first, on the ranks TE 1 gave back
    assert (out.kind, out.te, out.pool_ranks) == ("out", 2, POOL)


def test_a_lost_pool_te_s_ranks_leave_the_pool_for_good():
    """TE 1 (2 dies) lost at 3.0 s, found at 4.5 s: its ranks 10 and 11 stand for its dead
    dies, so they are never given back; TE 2 (4 dies) can then never scale out (a wait at each
    decision), TE 3 (2 dies) takes the 2 left."""
    s = scaler({1: 2, 2: 4, 3: 2}, standby={1, 2, 3})
    assert s.observe(0.0, [9, 0, 0, 0]).pool_ranks == (10, 11)
    s.drained(1)  # not draining: nothing
    s.lose(1, 3.0)
    assert s.pool.turns == [PoolTurn(te=1, ranks=(10, 11), taken_s=0.0, lost_s=3.0)]
    assert (s.pool.lost, s.pool.free) == ([10, 11], [12, 13])
    out = s.observe(4.5, [9, 9, 0, 0])  # TE 2 does not fit the 2 left: TE 3 (a skip)
    assert (out.te, out.pool_ranks, s.pool.num_skips) == (3, (12, 13), 1)
    assert s.observe(6.0, [9, 9, 0, 9]) is None and s.pool.num_waits == 1
    rows = pool_rows(s.pool.turns, {1: 1, 3: 1})
    assert [(r.rank, r.lost_s) for r in rows][:2] == [(10, 3.0), (11, 3.0)]
    assert all(math.isnan(r.lost_s) for r in rows[2:])


def test_a_pool_te_lost_while_its_drain_gives_its_ranks_back_keeps_them_out():
    """TE 1's drain finished (its ranks due back at the next decision), then it is found lost:
    its ranks leave the pool, not back into it."""
    s = scaler({1: 2, 2: 2}, standby={1, 2})
    s.observe(0.0, [9, 0, 0])
    assert s.observe(2.0, [2, 1, 0]).te == 1  # drained with 1 request left
    s.drained(1)
    s.lose(1, 2.5)
    s.observe(4.0, [9, 0, 0])
    assert s.pool.lost == [10, 11] and s.pool.turns[0].lost_s == 2.5
    assert s.pool.turns[1] == PoolTurn(te=2, ranks=(12, 13), taken_s=4.0)


def test_a_pool_te_that_does_not_fit_is_passed_over_for_the_next_standby_te():
    # TE 1 (4 dies) holds the whole pool; TE 2 (2 dies) cannot fit; TE 3 is launched whole
    s = scaler({1: 4, 2: 2}, standby={1, 2, 3})
    assert s.observe(0.0, [9, 0, 0, 0]).pool_ranks == POOL
    out = s.observe(2.0, [9, 9, 0, 0])
    assert (out.te, out.pool_ranks) == (3, ())
    assert (s.pool.num_skips, s.pool.num_waits) == (1, 0)


def test_a_pool_te_s_te_pre_load_is_its_communication_domain_formed():
    """Priced (no fixed scale_out_s): a pre-warmed TE's TE-Pre-Load is 0, a pool TE's the
    assumed scaling.comm_init_s (its communicator and windows are made at the scale-out);
    every other step the same."""
    cfg = load_config(
        "configs/colocated.yaml",
        [
            "cluster.groups=[{count: 1}, {count: 1, standby: true}, "
            "{count: 1, standby: true, pool: true}]",
            "cluster.pool=4",
            "autoscaler.enabled=true",
            "scaling.comm_init_s=4.5",
        ],
    )
    tes = DeploymentPlan.build(cfg, None, launcher_checks=False).cluster.tes
    standby, pooled = dict(scale_out_steps(cfg, tes[1])), dict(scale_out_steps(cfg, tes[2]))
    assert (standby["TE-Pre-Load"], pooled["TE-Pre-Load"]) == (0.0, 4.5)
    assert {k: v for k, v in pooled.items() if k != "TE-Pre-Load"} == {
        k: v for k, v in standby.items() if k != "TE-Pre-Load"
    }


def test_a_pool_fork_source_is_released_once_every_fork_that_read_it_loaded():
    """TE 1 (pool) was read by the forks of scale events 2 and 4; TE 3 by none. Both drained:
    TE 3 is due at once, TE 1 once events 2 and 4 reported their loads; its next turn starts
    with no readers."""
    gate = ReleaseGate()
    gate.read_by(1, 2)
    gate.read_by(1, 4)
    one = PoolTurn(te=1, ranks=(10,), taken_s=1.0, given_back_s=9.0)
    three = PoolTurn(te=3, ranks=(11,), taken_s=2.0, given_back_s=9.0)
    gate.hold([one, three])
    assert gate.due() == [three]
    assert gate.is_held(1) and gate.waiting_for(1) == [2, 4]
    gate.load_reported(2)
    assert gate.due() == [] and gate.waiting_for(1) == [4]
    gate.load_reported(4)
    assert gate.due() == [one] and not gate.is_held(1)
    gate.hold([PoolTurn(te=1, ranks=(10,), taken_s=12.0, given_back_s=15.0)])
    assert gate.waiting_for(1) == [] and len(gate.due()) == 1
