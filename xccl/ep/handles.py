"""What dispatch returns (xccl/ep/buffer.py): the rows' origins, and the handle combine consumes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class DispatchInfo:
    """The rows that arrived, contiguous per local expert slot.

    local_slots: [L] physical slots this die hosts, ascending; recv_x holds their rows in order.
    num_rows_per_slot: [L] int64 rows for each local slot.
    src_rank: [R] int64 rank each row came from; src_token: [R] its token index there;
    src_column: [R] its top-k column there (column num_topk = the dedicated shared expert).
    """

    local_slots: tuple[int, ...]
    num_rows_per_slot: np.ndarray
    src_rank: np.ndarray
    src_token: np.ndarray
    src_column: np.ndarray


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """What combine needs to send results home. Valid for one combine after its own dispatch.

    event_id: the dispatch's event id. seq: which dispatch of the buffer `buffer_id` made it.
    weights: [num_tokens, num_columns] float64 combine weights (0 where topk_idx is -1).
    send_counts: [num_members] rows sent to each member; send_token / send_column: [rows sent]
    token and column of each staged row (destination-major, the order peers pull them in).
    recv_counts: [num_members] rows pulled from each member.
    recv_perm: [R] for each row of recv_x, its index among the rows as pulled (source-major).
    """

    event_id: int
    seq: int
    buffer_id: int
    weights: np.ndarray
    send_counts: np.ndarray
    send_token: np.ndarray
    send_column: np.ndarray
    recv_counts: np.ndarray
    recv_perm: np.ndarray
