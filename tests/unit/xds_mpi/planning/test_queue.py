"""The queue model against hand-computed cases: evenly spaced arrivals, fixed iteration and
prefill times, so every TTFT and TPOT is known."""

from __future__ import annotations

import numpy as np
import pytest

from xds_mpi.planning.queue import serve

STEP_S = 0.1


def fixed_step(batch: float, kv_len: float, mean: float) -> float:
    return STEP_S


def test_pd_ttft_is_prefill_plus_one_decode_step_and_tpot_the_step():
    arrival = np.array([0.0, 0.0])
    ready = np.array([0.5, 1.0])  # one prefill lane, 0.5 s a prompt
    served = serve(
        arrival_s=arrival,
        prompt_len=np.array([100, 100]),
        output_len=np.array([3, 3]),
        num_groups=1,
        max_batch=4,
        step=fixed_step,
        tokens_per_step=1.0,
        prefill_end_s=ready,
    )
    # request 0: decode from 0.5; the prefill's token streams with the first step's at 0.6,
    # the third token at 0.7; request 1: ready at 1.0, first tokens 1.1, done 1.2
    np.testing.assert_allclose(served.ttft_s, [0.6, 1.1])
    np.testing.assert_allclose(served.finish_s, [0.7, 1.2])
    np.testing.assert_allclose(served.tpot_s, [STEP_S / 2, STEP_S / 2])


def test_batch_limit_makes_the_second_request_wait_for_a_slot():
    served = serve(
        arrival_s=np.array([0.0, 0.0]),
        prompt_len=np.array([10, 10]),
        output_len=np.array([4, 4]),
        num_groups=1,
        max_batch=1,
        step=fixed_step,
        tokens_per_step=1.0,
        prefill_end_s=np.array([0.0, 0.0]),
    )
    # one slot: request 0 runs 0.0-0.3 (the prefill's token and 3 steps); request 1 joins at
    # 0.3, first tokens 0.4, done 0.6
    np.testing.assert_allclose(served.ttft_s, [0.1, 0.4])
    np.testing.assert_allclose(served.finish_s, [0.3, 0.6])


def test_colocated_chunks_pay_their_price_in_the_iteration():
    # a 200-token prompt in chunks of 100 at 1 ms a token: each of the 2 prefill iterations
    # costs the step + 0.1 s; the last chunk gives the first token; 2 more tokens at 0.1 s
    served = serve(
        arrival_s=np.array([0.0]),
        prompt_len=np.array([200]),
        output_len=np.array([3]),
        num_groups=1,
        max_batch=4,
        step=fixed_step,
        tokens_per_step=1.0,
        chunk_tokens=100,
        chunk_cost=lambda start, end: (end - start) * 1e-3,
    )
    assert served.ttft_s[0] == pytest.approx(0.4)
    assert served.finish_s[0] == pytest.approx(0.6)
    assert served.tpot_s[0] == pytest.approx(STEP_S)


def test_mtp_tokens_per_step_shorten_tpot():
    served = serve(
        arrival_s=np.array([0.0]),
        prompt_len=np.array([10]),
        output_len=np.array([9]),
        num_groups=1,
        max_batch=1,
        step=fixed_step,
        tokens_per_step=2.0,
        prefill_end_s=np.array([0.0]),
    )
    # the prefill's token, then 8 at 2 a step: 4 iterations, the first tokens after the first
    # -> (0.4 - 0.1) / 8
    assert served.finish_s[0] == pytest.approx(0.4)
    assert served.tpot_s[0] == pytest.approx(0.3 / 8)
