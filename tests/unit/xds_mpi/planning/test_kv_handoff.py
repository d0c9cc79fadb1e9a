"""The KV hand-off to decode against hand-computed cases: which DP group the balancer picks,
in which order the KV lands, at which iteration a request joins, and the batch the barrier
then prices."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.planning.kv_handoff import UNBOUNDED, Balance, HeapBalancer, KvHandoff, batch_of
from xds_mpi.planning.queue import serve
from xds_mpi.scheduling.balancer import DecodeBalancer
from xds_mpi.workload.requests import Request

STEP_S = 0.1


def handoff(ready, transfer, prompt, output, *, num_groups=2, max_batch=2) -> KvHandoff:
    return KvHandoff(
        np.array(ready, float),
        np.array(transfer, float),
        np.array(prompt),
        np.array(output),
        req_ids=np.arange(len(ready)),
        num_groups=num_groups,
        max_batch=max_batch,
        balance=Balance(block_tokens=16, mtp_depth=0),
    )


def test_the_balancer_picks_groups_and_a_full_pod_waits_for_a_finish():
    # reservations (prompt + output, in 16-token blocks): 128, 32, 48, 16, 16 tokens
    h = handoff(
        ready=[0.0, 0.0, 0.02, 0.02, 0.03],
        transfer=[0.01, 0.005, 0.001, 0.002, 0.004],
        prompt=[100, 20, 40, 10, 10],
        output=[28, 12, 8, 6, 6],
    )
    h.decide(0.03)
    # r0 -> group 0 (a tie, the lower group); r1 -> 1 (less KV reserved); r2 -> 1 (80 < 128);
    # r3 -> 0 (group 1 holds its 2); r4: both full, it waits
    assert h.land(0.005) == [(1, 1)]  # r1's KV moves faster than r0's
    assert h.land(0.01) == [(0, 0)]
    assert h.land(0.03) == [(2, 1), (3, 0)]  # landed at 0.021 and 0.022
    assert h.is_blocked and h.next_s() == np.inf
    h.finished([1], 0.05)  # r1 frees its slot at 0.05: r4 is decided then, to group 1
    h.decide(0.06)
    assert not h.is_blocked and h.land(0.0539) == []
    assert h.land(0.0541) == [(4, 1)]  # 0.05 + its 0.004
    assert h.is_done


def test_kv_lands_in_transfer_order_and_joins_at_an_iteration_boundary():
    # A's prefill ends first (0.0) but its KV takes 0.25 s; B's ends at 0.1 and lands at 0.11.
    # The dies are idle until 0.11: B runs alone 0.11-0.21 (first token) and 0.21-0.31; A lands
    # during that iteration and joins the next one, at 0.31: first token 0.41, done 0.51
    served = serve(
        arrival_s=np.array([0.0, 0.0]),
        prompt_len=np.array([10, 10]),
        output_len=np.array([3, 3]),
        num_groups=1,
        max_batch=4,
        step=lambda fullest, kv, mean: STEP_S,
        tokens_per_step=1.0,
        prefill_end_s=np.array([0.0, 0.1]),
        transfer_s=np.array([0.25, 0.01]),
    )
    np.testing.assert_allclose(served.first_s, [0.41, 0.21])
    np.testing.assert_allclose(served.finish_s, [0.51, 0.31])


def test_the_barrier_prices_the_fullest_group_the_balancer_made():
    # one long prompt holds group 0's KV, so the three short ones all go to group 1: an
    # iteration costs 3 requests' step (0.3 s), not the even split's 2 (0.2 s); the prefill's
    # token streams with the first step's, the third token ends the second
    served = serve(
        arrival_s=np.zeros(4),
        prompt_len=np.array([1000, 10, 10, 10]),
        output_len=np.array([3, 3, 3, 3]),
        num_groups=2,
        max_batch=8,
        step=lambda fullest, kv, mean: STEP_S * fullest,
        tokens_per_step=1.0,
        prefill_end_s=np.zeros(4),
    )
    np.testing.assert_allclose(served.ttft_s, [0.3] * 4)
    np.testing.assert_allclose(served.finish_s, [0.6] * 4)


def test_a_one_token_output_ends_at_its_prefill():
    served = serve(
        arrival_s=np.array([0.0, 0.0]),
        prompt_len=np.array([10, 10]),
        output_len=np.array([1, 2]),
        num_groups=1,
        max_batch=4,
        step=lambda fullest, kv, mean: STEP_S,
        tokens_per_step=1.0,
        prefill_end_s=np.array([0.5, 0.5]),
    )
    np.testing.assert_allclose(served.ttft_s, [0.5, 0.6])
    assert np.isnan(served.tpot_s[0])


def test_batch_of_takes_the_fullest_group_and_its_kv():
    b = batch_of(np.array([0, 1, 1, 2, 2]), np.array([900.0, 100, 300, 50, 50]), 4)
    # groups 1 and 2 hold two each; group 1's mean KV (200) is the longer
    assert (b.fullest, b.kv_len, b.mean) == (2, pytest.approx(200.0), pytest.approx(1.25))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_heap_balancer_picks_as_the_emulator_s_balancer(seed):
    # the same random dispatches and finishes on both: every pick the same, full pods included
    rng = np.random.default_rng(seed)
    balance = Balance(block_tokens=16, mtp_depth=1)
    fast = HeapBalancer(range(7), max_batch=3, balance=balance)
    reference = DecodeBalancer(
        range(7), max_batch=3, kv_capacity_tokens=UNBOUNDED, block_tokens=16, mtp_depth=1
    )
    held: list[int] = []
    for req_id in range(400):
        if held and rng.random() < 0.45:
            done = held.pop(int(rng.integers(len(held))))
            assert fast.on_complete(done) == reference.on_complete(done)
            continue
        req = Request(
            req_id=req_id,
            prompt=range(int(rng.integers(1, 200))),
            max_new_tokens=int(rng.integers(1, 50)),
        )
        group = reference.pick(req)
        assert fast.pick(req) == group, req_id
        if group is not None:
            fast.on_dispatch(group, req)
            reference.on_dispatch(group, req)
            held.append(req_id)
