"""Single-process oracles for XCCL's protocols. Tests compare distributed results with these."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from xccl.quant import quant_dequant


def p2p_deliveries(
    messages: Iterable[tuple[int, int, int, bytes]],
) -> dict[tuple[int, int], list[tuple[int, bytes]]]:
    """What send/receive must deliver: for each (src, dst) pair, the (event id, bytes) of every
    message src sent to dst, in the order src sent them (a pair's ring is FIFO)."""
    delivered: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    for src, dst, event_id, data in messages:
        delivered.setdefault((src, dst), []).append((event_id, bytes(data)))
    return delivered


def tagged_payload(src: int, dst: int, seq: int, nbytes: int) -> np.ndarray:
    """Bytes that say where they came from: a stream seeded by (src, dst, seq), so a misrouted or
    reordered message differs from what its receiver expects."""
    return np.random.default_rng((src, dst, seq)).integers(0, 256, nbytes, dtype=np.uint8)


def ep_route_reference(
    topk_idx: np.ndarray, log2phy, shared_slots, src_rank: int
) -> list[tuple[int, int, int]]:
    """(token, column, physical slot) of every row a die sends, written out longhand: replica
    (src_rank + token) mod replicas of each chosen expert, then the dedicated shared slot
    (src_rank + token) mod len(shared_slots) as the last column."""
    rows = []
    for token in range(topk_idx.shape[0]):
        for column in range(topk_idx.shape[1]):
            expert = int(topk_idx[token, column])
            if expert >= 0:
                replicas = log2phy[expert]
                rows.append((token, column, replicas[(src_rank + token) % len(replicas)]))
        if shared_slots:
            rows.append(
                (token, topk_idx.shape[1], shared_slots[(src_rank + token) % len(shared_slots)])
            )
    return rows


def dispatch_reference(
    xs, topk_idxs, log2phy, shared_slots, slot_owner, members, *, use_int8: bool = False
) -> dict[int, dict[str, np.ndarray]]:
    """What every member receives, from all-gathered inputs: rows grouped by local slot
    (ascending), then by source rank, token and column. xs[i] / topk_idxs[i] belong to
    members[i]. Returns per rank: x [R, hidden], slot, src_rank, src_token, src_column [R]."""
    arrivals: dict[int, list] = {rank: [] for rank in members}
    for src, x, topk_idx in zip(members, xs, topk_idxs):
        rows = quant_dequant(x) if use_int8 and len(x) else x
        for token, column, slot in ep_route_reference(topk_idx, log2phy, shared_slots, src):
            arrivals[slot_owner[slot]].append((slot, src, token, column, rows[token]))
    out = {}
    for rank, rows in arrivals.items():
        rows.sort(key=lambda r: r[:4])
        hidden = xs[0].shape[1]
        out[rank] = {
            "x": np.array([r[4] for r in rows]).reshape(len(rows), hidden),
            **{
                name: np.array([r[i] for r in rows], np.int64)
                for i, name in enumerate(["slot", "src_rank", "src_token", "src_column"])
            },
        }
    return out


def combine_reference(
    xs,
    topk_idxs,
    topk_weights,
    log2phy,
    shared_slots,
    members,
    expert_fn,
    *,
    use_int8: bool = False,
) -> list[np.ndarray]:
    """y[t] = sum over the token's columns, in column order, of weight x expert_fn(slot, row);
    the shared column has weight 1. expert_fn(slot, rows [n, hidden]) -> [n, hidden]. Sums in
    float64 whatever x's dtype, as combine does."""
    ys = []
    for src, x, topk_idx, w in zip(members, xs, topk_idxs, topk_weights):
        rows = quant_dequant(x) if use_int8 and len(x) else x
        y = np.zeros(x.shape, np.float64)
        for token, column, slot in ep_route_reference(topk_idx, log2phy, shared_slots, src):
            weight = 1.0 if column == topk_idx.shape[1] else float(w[token, column])
            out = expert_fn(slot, rows[token : token + 1])[0].astype(np.float64)
            y[token] = y[token] + weight * out
        ys.append(y)
    return ys


def a2e_reference(
    xs, topk_idxs, log2phy, shared_slots, slot_owner, attention, experts, *, use_int8: bool = False
) -> dict[int, dict[str, np.ndarray]]:
    """What every expert die receives from one DP domain's A2E (with or without trampolines):
    rows sorted by slot, source attention rank, token, column. xs[i] / topk_idxs[i] belong to
    attention[i]; routed rows go through INT8 when enabled, shared-column rows never do (the
    reference model quantizes the routed experts' input only). Returns per expert rank: x [R,
    hidden], slot, src_rank, src_token, src_column [R]."""
    arrivals: dict[int, list] = {rank: [] for rank in experts}
    for src, x, topk_idx in zip(attention, xs, topk_idxs):
        routed = quant_dequant(x) if use_int8 and len(x) else x
        for token, column, slot in ep_route_reference(topk_idx, log2phy, shared_slots, src):
            row = routed[token] if column < topk_idx.shape[1] else x[token]
            arrivals[slot_owner[slot]].append((slot, src, token, column, row))
    hidden, out = xs[0].shape[1], {}
    for rank, rows in arrivals.items():
        rows.sort(key=lambda r: r[:4])
        out[rank] = {
            "x": np.array([r[4] for r in rows]).reshape(len(rows), hidden),
            **{
                name: np.array([r[i] for r in rows], np.int64)
                for i, name in enumerate(["slot", "src_rank", "src_token", "src_column"])
            },
        }
    return out


def e2a_reference(
    xs,
    topk_idxs,
    topk_weights,
    log2phy,
    shared_slots,
    attention,
    expert_fn,
    *,
    use_int8: bool = False,
) -> list[np.ndarray]:
    """y[t] of every attention die after E2A: its columns' expert outputs, weighted, summed in
    column order from zero in float64 (the shared column last, weight 1, on the unquantized
    row)."""
    ys = []
    for src, x, topk_idx, w in zip(attention, xs, topk_idxs, topk_weights):
        routed = quant_dequant(x) if use_int8 and len(x) else x
        y = np.zeros(x.shape, np.float64)
        for token, column, slot in ep_route_reference(topk_idx, log2phy, shared_slots, src):
            is_shared = column == topk_idx.shape[1]
            row = (x if is_shared else routed)[token : token + 1]
            weight = 1.0 if is_shared else float(w[token, column])
            y[token] = y[token] + weight * expert_fn(slot, row)[0].astype(np.float64)
        ys.append(y)
    return ys


def a2e_metadata_writes(
    num_attention_dies: int, num_expert_dies: int, group_size: int, *, use_trampolines: bool
) -> dict[str, int]:
    """Records written per call by one attention die, one trampoline and one expert die (A2E +
    E2A, both stages). Trampolines: attention 1; trampoline E (A2E') + 1 (E2A) + G (its own E2A');
    other expert dies G. Direct: attention E; expert dies G."""
    if use_trampolines:
        return {
            "attention": 1,
            "trampoline": num_expert_dies + 1 + group_size,
            "expert": group_size,
        }
    return {"attention": num_expert_dies, "trampoline": group_size, "expert": group_size}
