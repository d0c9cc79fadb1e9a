"""What dispatch/combine (xccl/ep/buffer.py) and A2E/E2A (xccl/afd/buffer.py) share: which physical
slot each column of a token goes to, the combine weights, and the weighted sum of the returned
columns."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np


@functools.lru_cache(maxsize=256)
def _replicas(log2phy: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """(replicas [E, max R] physical slots, -1 padded; num_replicas [E]) of a placement, kept
    while the placement is in use (a MoE layer's log2phy changes only at an EPLB swap)."""
    num_replicas = np.array([len(r) for r in log2phy], np.int64)  # [E]
    replicas = np.full((len(log2phy), max(num_replicas, default=1)), -1, np.int64)  # [E, max R]
    for expert, slots in enumerate(log2phy):
        replicas[expert, : len(slots)] = slots
    return replicas, np.maximum(num_replicas, 1)


def _replicas_of(log2phy: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    return _replicas(tuple(map(tuple, log2phy)))


def rotation_table(
    log2phy: Sequence[Sequence[int]], num_tokens: int, src_rank: int = 0
) -> np.ndarray:
    """[T, E] physical slot each token position uses for each logical expert (-1 = none).

    Column e rotates over expert e's replicas by position: row t takes replica
    (src_rank + t) mod replicas (§4.5 step 4). The die's rank shifts the start so that dies with
    one token each do not all pick the first replica.
    """
    replicas, num_replicas = _replicas_of(log2phy)
    position = src_rank + np.arange(num_tokens)[:, None]  # [T, 1]
    return replicas[np.arange(len(log2phy))[None, :], position % num_replicas[None, :]]  # [T, E]


def select_slots(
    topk_idx: np.ndarray,
    log2phy: Sequence[Sequence[int]],
    shared_slots: Sequence[int],
    src_rank: int,
) -> np.ndarray:
    """[T, K] logical experts (-1 = none) -> [T, C] physical slots (-1 = none).

    The rotation table's entries at topk_idx (computed for those entries only): spread over
    replicas by position, no communication (§4.5 step 4). With dedicated shared-expert slots,
    column K is slot shared_slots[(src_rank + token) mod len(shared_slots)].
    """
    num_tokens, top_k = topk_idx.shape
    replicas, num_replicas = _replicas_of(log2phy)
    expert = np.where(topk_idx >= 0, topk_idx, 0)  # [T, K]
    position = src_rank + np.arange(num_tokens)[:, None]  # [T, 1]
    phy = np.where(topk_idx >= 0, replicas[expert, position % num_replicas[expert]], -1)
    if shared_slots:
        token = np.arange(num_tokens)
        shared = np.asarray(shared_slots)[(src_rank + token) % len(shared_slots)]
        phy = np.concatenate([phy, shared[:, None]], axis=1)
    return phy


def combine_weights(topk_idx: np.ndarray, topk_weights: np.ndarray, num_columns: int) -> np.ndarray:
    """[T, K] weights -> [T, C] float64: 0 where topk_idx is -1, 1 in the shared column (K)."""
    num_tokens, top_k = topk_idx.shape
    weights = np.zeros((num_tokens, num_columns))
    weights[:, :top_k] = np.where(topk_idx >= 0, topk_weights, 0.0)
    weights[:, top_k:] = 1.0
    return weights


# Tokens per block of weighted_column_sum: a block of y and one term stay in cache (16 x 7168
# float64 = 0.9 MiB each), faster than whole columns (docs/scale.md).
SUM_BLOCK_TOKENS = 16


def weighted_column_sum(
    outs: np.ndarray, token: np.ndarray, column: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """y [T, hidden] float64: each token's returned rows, weighted, summed column by column.

    outs: [R, hidden] rows (any float dtype: the wire's). token / column: [R] each row's token and
    column. weights: [T, C] float64. The sum runs in float64 in fixed column order from zero, so
    it is the same on every run whatever order rows arrived in, and the reference can repeat it.
    """
    num_tokens, num_columns = weights.shape
    if num_tokens <= SUM_BLOCK_TOKENS:
        return _column_sum_one_block(outs, token, column, weights)
    y = np.zeros((num_tokens, outs.shape[1]), np.float64)
    by_column = []  # per column: its rows sorted by token, and those tokens
    for c in range(num_columns):
        rows = np.flatnonzero(column == c)
        rows = rows[np.argsort(token[rows], kind="stable")]
        by_column.append((rows, token[rows]))  # each token at most once per column
    # Blocks of tokens keep y's block and one term in cache while every column adds to it;
    # each element still sums its columns in order from zero.
    term = np.empty((min(SUM_BLOCK_TOKENS, num_tokens), outs.shape[1]), np.float64)
    for t0 in range(0, num_tokens, SUM_BLOCK_TOKENS):
        t1 = min(t0 + SUM_BLOCK_TOKENS, num_tokens)
        for c, (rows, rows_token) in enumerate(by_column):
            lo, hi = np.searchsorted(rows_token, (t0, t1)).tolist()
            part, part_token = term[: hi - lo], rows_token[lo:hi]
            # The float64 weights promote the rows exactly, as an astype would.
            np.multiply(outs[rows[lo:hi]], weights[part_token, c, None], out=part)
            if hi - lo == t1 - t0:  # every token of the block, in order: a slice
                y[t0:t1] += part
            else:
                y[part_token] += part
    return y


def _column_sum_one_block(
    outs: np.ndarray, token: np.ndarray, column: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """`weighted_column_sum` of a batch that fits one block (a decode step's few tokens): every
    row weighted at once, then the columns added in order from zero, as the blocked sum adds
    them (a quarter of its numpy calls at 2 tokens x 3 columns: 19 against 80 us)."""
    num_tokens, num_columns = weights.shape
    y = np.zeros((num_tokens, outs.shape[1]), np.float64)
    order = np.lexsort((token, column))  # by column, then token
    rows_token, rows_column = token[order], column[order]
    terms = outs[order] * weights[rows_token, rows_column, None]  # float64, as in the blocks
    bounds = np.searchsorted(rows_column, np.arange(num_columns + 1)).tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):  # column by column; a token once per column
        if hi - lo == num_tokens:  # every token, in order: a slice
            y += terms[lo:hi]
        else:
            y[rows_token[lo:hi]] += terms[lo:hi]
    return y
