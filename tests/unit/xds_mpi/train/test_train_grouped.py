"""The training MoE's batched routed experts (xds_mpi/train/grouped.py) against the per-expert loop
they replaced, kept here as the oracle: the same outputs and the same gradients for the input and
for every parameter, at tiny's routing (16 experts, top-2) and ep288's (256, top-8, 8 groups, 4
kept).

Tolerance: float64 agrees to 1e-12 absolute (measured: ~1e-16, the matmuls only block their sums
differently); float32 to 1e-5 (measured: ~1e-7).
"""

from __future__ import annotations

import dataclasses

import pytest

from xds_mpi.model.shapes import compute_shape

torch = pytest.importorskip("torch", reason="torch is the train extra: pip install -e '.[train]'")

from xds_mpi.train.grouped import bucket_capacity, grouped_swiglu, plan_buckets  # noqa: E402
from xds_mpi.train.torch_model import MoE  # noqa: E402

torch.set_num_threads(1)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
ROUTINGS = {
    "tiny": {},
    "ep288": dict(num_routed_experts=256, top_k=8, num_expert_groups=8, topk_groups=4),
}


def loop_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE forward as it was: one gather, SwiGLU and scatter per expert used."""
    topk_idx, topk_weight = moe.gate(x)
    out = torch.zeros_like(x)
    for expert in moe.shared_experts:
        out = out + expert(x)
    routed = x.new_zeros(*topk_idx.shape, x.shape[1])
    for expert_idx in topk_idx.unique().tolist():
        row_idx, k_idx = (topk_idx == expert_idx).nonzero(as_tuple=True)
        routed[row_idx, k_idx] = moe.experts[expert_idx](x[row_idx])
    return out + (topk_weight[..., None] * routed).sum(1)


def _moe(routing: str, dtype: torch.dtype, *, seed: int = 0) -> MoE:
    cfg = dataclasses.replace(compute_shape(), **ROUTINGS[routing])
    torch.manual_seed(seed)
    moe = MoE(cfg).to(dtype)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
        # A hot expert, so the rows per expert span several bucket capacities and some get none.
        moe.gate.bias[3] = 0.5
    return moe


def _forward_and_grads(forward, moe: MoE, x: torch.Tensor):
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = forward(moe, x)
    # A fixed, uneven upstream gradient: every output element weighs differently.
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    grads = {name: p.grad for name, p in moe.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_batched_experts_match_the_loop_in_values_and_gradients(routing, dtype):
    moe = _moe(routing, dtype)
    x = torch.randn(
        300, moe.gate.cfg.hidden, dtype=dtype, generator=torch.Generator().manual_seed(1)
    )
    out, x_grad, grads = _forward_and_grads(MoE.forward, moe, x)
    want, want_x_grad, want_grads = _forward_and_grads(loop_forward, moe, x)
    tol = TOLERANCE[dtype]
    assert (out - want).abs().max() < tol
    assert (x_grad - want_x_grad).abs().max() < tol
    assert want_grads.keys() == grads.keys()
    num_unused = 0
    for name, want_grad in want_grads.items():
        if want_grad is None:  # an expert no row chose, or the gate's bias (no gradient path)
            assert grads[name] is None or not grads[name].any(), name
            num_unused += 1
            continue
        assert grads[name] is not None, f"{name}: no gradient"
        assert (grads[name] - want_grad).abs().max() < tol * max(1.0, want_grad.abs().max()), name
    # The check covers experts that got rows and experts that got none.
    assert 0 < num_unused < len(want_grads) // 2


def test_every_assignment_lands_in_one_bucket_with_under_one_and_a_half_times_the_rows():
    topk_idx = _moe("ep288", torch.float64).gate(torch.randn(300, 128, dtype=torch.float64))[0]
    buckets = plan_buckets(topk_idx, 256)
    assigned = torch.cat([b.assign_idx for b in buckets])
    assert sorted(assigned.tolist()) == list(range(topk_idx.numel()))
    assert len({b.capacity for b in buckets}) == len(buckets) > 2
    flat = topk_idx.flatten()
    for b in buckets:
        experts = flat[b.assign_idx]
        assert set(experts.tolist()) == set(b.expert_idx)
        # Each expert's rows fill slots [place * capacity, place * capacity + count) in order.
        local = torch.tensor([b.expert_idx.index(e) for e in experts.tolist()])
        assert torch.equal(b.slot_idx // b.capacity, local)
        assert len(set(b.slot_idx.tolist())) == len(b.slot_idx)
    num_slots = sum(len(b.expert_idx) * b.capacity for b in buckets)
    assert num_slots < 1.5 * topk_idx.numel()


def test_no_rows_give_no_outputs():
    moe = _moe("tiny", torch.float64)
    out = grouped_swiglu(
        torch.zeros(0, 128, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.int64), moe.experts
    )
    assert out.shape == (0, 2, 128)


def test_a_bucket_holds_its_rows_with_under_half_again_as_many():
    capacities = [bucket_capacity(n) for n in range(1, 5000)]
    assert all(n <= c < 1.5 * n for n, c in enumerate(capacities, start=1))
    assert sorted(set(capacities))[:9] == [1, 2, 3, 4, 6, 8, 12, 16, 24]
    assert bucket_capacity(0) == 0
