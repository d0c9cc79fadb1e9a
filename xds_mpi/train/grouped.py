"""The routed experts of a whole batch as a few batched matmuls, not one small matmul per expert.

A training step sends 2048 rows x top_k to the routed experts; at 256 experts a Python loop over
them (gather, three matmuls, scatter, and autograd's copies of the scattered [rows, top_k, hidden]
tensor in the backward pass) made a step about 10x slower than at 16 (docs/scale.md, ep288).
Instead:

Step 1: sort the (row, k) assignments by expert (`plan_buckets`).
Step 2: experts whose row count rounds up to the same capacity (`bucket_capacity`) form a
        bucket; a bucket runs as one [experts, capacity, hidden] batched SwiGLU on the bucket's
        stacked weights, each expert's rows padded with zero rows to the capacity (the zero
        rows' outputs are dropped, so they add nothing to values or gradients).
Step 3: each assignment's output goes back to its (row, k) place (`grouped_swiglu`).

The module's parameters stay one SwiGLU per expert, so the checkpoint's names and shapes do not
change; tests/unit/xds_mpi/train/test_train_grouped.py checks values and gradients against the
per-expert loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Experts padded to one capacity, run as one batched matmul."""

    expert_idx: list[int]  # the bucket's experts, ascending
    capacity: int  # rows per expert after padding (bucket_capacity)
    assign_idx: torch.Tensor  # [n] int64: flat assignments row * top_k + k, by expert
    slot_idx: torch.Tensor  # [n] int64: each one's row in the padded [experts * capacity] rows


def bucket_capacity(num_rows: int) -> int:
    """The smallest 2^i or 3 x 2^i that holds num_rows (0 for none): under 1.5x the rows (a
    bucket's padding), yet few buckets. Padding measured at 256 experts on a training batch:
    1.18x, against 1.45x with powers of two only, which ran 20% slower."""
    if num_rows <= 2:
        return num_rows
    power = 1 << (num_rows - 1).bit_length()  # the next power of two
    return power * 3 // 4 if num_rows <= power * 3 // 4 else power


def plan_buckets(topk_idx: torch.Tensor, num_experts: int) -> list[Bucket]:
    """topk_idx: [rows, top_k] int64 -> the buckets covering every assignment once."""
    flat = topk_idx.flatten()  # [rows * top_k] expert of each assignment
    # Step 1: assignments by expert; each one's place among its expert's rows.
    order = flat.argsort(stable=True)  # [rows * top_k]
    by_expert = flat[order]
    counts = torch.bincount(flat, minlength=num_experts)  # [num_experts]
    starts = counts.cumsum(0) - counts
    place = torch.arange(len(flat)) - starts[by_expert]  # [rows * top_k]
    # Step 2: one bucket per capacity that some expert needs.
    capacity = [bucket_capacity(n) for n in counts.tolist()]
    capacity_of = torch.tensor(capacity)[by_expert]  # [rows * top_k]
    buckets = []
    for cap in sorted(set(capacity) - {0}):
        experts = [e for e, c in enumerate(capacity) if c == cap]
        local_idx = torch.zeros(num_experts, dtype=torch.int64)  # expert -> place in the bucket
        local_idx[experts] = torch.arange(len(experts))
        is_in = capacity_of == cap
        buckets.append(
            Bucket(
                expert_idx=experts,
                capacity=cap,
                assign_idx=order[is_in],
                slot_idx=local_idx[by_expert[is_in]] * cap + place[is_in],
            )
        )
    return buckets


def grouped_swiglu(
    x: torch.Tensor, topk_idx: torch.Tensor, experts: Sequence[nn.Module]
) -> torch.Tensor:
    """x: [rows, hidden], topk_idx: [rows, top_k] int64, experts: SwiGLU modules (w1, w3, w2)
    -> [rows, top_k, hidden]: row r's k-th routed expert's output."""
    num_rows, top_k = topk_idx.shape
    if num_rows == 0:
        return x.new_zeros(0, top_k, x.shape[1])
    outputs, assigned = [], []
    for bucket in plan_buckets(topk_idx, len(experts)):
        w1, w3, w2 = (
            torch.stack([getattr(experts[e], name).weight for e in bucket.expert_idx])
            for name in ("w1", "w3", "w2")
        )  # [experts, inter, hidden] x 2, [experts, hidden, inter]
        num_slots = len(bucket.expert_idx) * bucket.capacity
        padded = x.new_zeros(num_slots, x.shape[1]).index_copy(
            0, bucket.slot_idx, x[bucket.assign_idx // top_k]
        )
        padded = padded.view(len(bucket.expert_idx), bucket.capacity, -1)  # [experts, cap, hidden]
        hidden = F.silu(padded @ w1.transpose(1, 2)) * (padded @ w3.transpose(1, 2))
        out = (hidden @ w2.transpose(1, 2)).view(num_slots, -1)  # [experts * cap, hidden]
        outputs.append(out[bucket.slot_idx])
        assigned.append(bucket.assign_idx)
    # Step 3: back to (row, k) order; the buckets cover every assignment exactly once.
    assign_idx = torch.cat(assigned)  # [rows * top_k]
    inverse = torch.empty_like(assign_idx)
    inverse[assign_idx] = torch.arange(len(assign_idx))
    return torch.cat(outputs)[inverse].view(num_rows, top_k, -1)
