"""The PD-transfer task (xDeepServe §5.1 step 3), torch-free: the JE unpickles it on the host rank.

A task holds only metadata: the request, the first token and MTP drafts the prefill produced,
where the prompt's latent KV sits on the prefill die (its cache slots, "the addresses of the KV
blocks") and the shape of the MTP state decode continues from (xds_mpi/pd/kv.py moves the bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.workload.requests import Request


@dataclass(frozen=True, kw_only=True)
class PdTask:
    """One prefilled request waiting for its KV transfer. prefill_rank: the die holding the
    blocks; slots: its cache slots of positions 0..kv_len-1; first_token / drafts: what the
    prefill sampled and the MTP drafts of its last position; mtp_next_pos / mtp_rows: the MTP
    state (per depth: next position, committed rows not yet consumed); timings in wall seconds
    (time.time()) and the prefill die's virtual seconds."""

    req: Request
    prefill_rank: int
    slots: tuple[int, ...]
    first_token: int
    drafts: tuple[int, ...] = ()
    mtp_next_pos: tuple[int, ...] = ()
    mtp_rows: tuple[int, ...] = ()
    assigned_at: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    queue_v: float = 0.0  # virtual seconds from entering the leader's pool to the first step
    prefill_v: float = 0.0  # virtual seconds of the iterations that prefilled it
    start_v: float = 0.0  # the prefill die's virtual clock at its first prefill step's start
    end_v: float = 0.0  # ... at the end of the step that sampled its first token

    @property
    def req_id(self) -> int:
        return self.req.req_id

    @property
    def kv_len(self) -> int:
        return len(self.slots)
