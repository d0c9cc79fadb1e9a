"""The executor's sampling step without MPI: a prompt's last chunk is sampled from its last row
only (its other tokens are prompt, not drafts), a verify row's drafts are checked in order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from xccl.vclock import VirtualClock
from xds_mpi.config.schema import ModelConfig
from xds_mpi.execution.executor import ColocatedExecutor
from xds_mpi.model.weights import build_model
from xds_mpi.scheduling.scheduler import Entry


def executor() -> ColocatedExecutor:
    model = build_model(ModelConfig())
    return ColocatedExecutor(
        model,
        None,
        phy2log=(),
        log2phy=(),
        table=None,
        cache=None,
        pricer=SimpleNamespace(clock=VirtualClock()),
        slots=None,
    )


def rows(ex: ColocatedExecutor, *, seed: int) -> np.ndarray:
    """3 last-block rows [3, hidden]."""
    return np.random.default_rng(seed).standard_normal((3, ex.model.cfg.hidden))


def test_a_last_prompt_chunk_samples_its_last_row_whatever_its_other_tokens():
    ex = executor()
    x = rows(ex, seed=0)
    best = int(ex.model.logits(x[-1:]).argmax())
    # The chunk's second token equals the greedy choice: it must not be taken for a draft.
    entry = Entry(req_id=7, start_pos=4, input_ids=(11, best, 12), is_sampled=True)
    sampled, _ = ex._verify([entry], x)
    assert sampled == {7: [best]}


def test_verify_rows_accept_the_agreeing_drafts_then_one_main_model_token():
    ex = executor()
    x = rows(ex, seed=1)
    greedy = ex.model.logits(x).argmax(-1).tolist()  # the main model's choice per row
    agree = Entry(
        req_id=1, start_pos=9, input_ids=(5, greedy[0], greedy[1]), is_sampled=True, num_drafts=2
    )
    assert ex._verify([agree], x)[0] == {1: greedy}  # both drafts + the bonus token
    other = (greedy[1] + 1) % ex.model.cfg.vocab_size
    reject = Entry(
        req_id=2, start_pos=9, input_ids=(5, greedy[0], other), is_sampled=True, num_drafts=2
    )
    assert ex._verify([reject], x)[0] == {2: greedy[:2]}  # draft 2 rejected: correction


def test_a_die_makes_the_experts_its_slots_hold_at_start_up_and_no_others():
    model = build_model(ModelConfig())
    num_experts = model.cfg.num_routed_experts
    ex = ColocatedExecutor(
        model,
        SimpleNamespace(local_slots=(4, 5, 6, 7, num_experts)),  # 4 routed slots, a shared one
        phy2log=tuple(range(num_experts)),
        log2phy=tuple((e,) for e in range(num_experts)),
        table=None,
        cache=None,
        pricer=SimpleNamespace(clock=VirtualClock()),
        slots=SimpleNamespace(is_routed=lambda slot: slot < num_experts),
    )
    moe_layers = ex.moe_layers()
    assert moe_layers and all(
        item is None for layer in moe_layers for item in model.moe_of(layer).experts.items
    )
    ex.build_hosted_experts()
    for layer in moe_layers:
        made = [e for e, item in enumerate(model.moe_of(layer).experts.items) if item is not None]
        assert made == [4, 5, 6, 7]
