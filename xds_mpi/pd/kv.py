"""The KV bytes a PD-transfer task (xds_mpi/pd/task.py) moves (xDeepServe §5.1 steps
6-8): packed only when the decode die asks for them (it posted its irecv), and unpacked into the
decode die's own slots.

Exactness: the message is the prefill die's latent cache rows copied bit for bit (`pack_kv`
views the tensors' bytes, `unpack_kv` writes the same values into the decode die's slots), so
decode attends over exactly the KV it would have computed itself; the MTP rows (h^k of positions
not yet consumed) travel the same way. With scheduler.kv_int8 the latent part moves as its INT8
values and per-token scales (`LatentCache.pack`): fewer bytes on the wire.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.execution.mtp import MtpState
from xds_mpi.model.mla import LatentCache
from xds_mpi.pd.task import PdTask


def kv_nbytes(task: PdTask, cache: LatentCache, hidden: int) -> int:
    """Bytes of the task's message: every cache layer's latent + rope key rows, then MTP rows."""
    mtp_nbytes = sum(task.mtp_rows) * hidden * cache.rope_key.itemsize
    return task.kv_len * cache.token_nbytes + mtp_nbytes


def pack_kv(task: PdTask, cache: LatentCache, mtp: MtpState | None) -> np.ndarray:
    """The task's message as one contiguous byte array (a copy: the blocks stay untouched)."""
    parts = cache.pack(np.array(task.slots, dtype=np.int64))
    if mtp is not None:
        parts += [row.reshape(-1).view(np.uint8) for rows in mtp.rows for row in rows]
    return np.concatenate(parts)


def unpack_kv(
    task: PdTask, buf: np.ndarray, cache: LatentCache, slots: list[int], hidden: int
) -> MtpState | None:
    """Write the message into `cache` at the decode die's `slots`; the MTP state, if any."""
    at = cache.unpack(np.array(slots, dtype=np.int64), buf)
    if not task.mtp_next_pos:
        return None
    values = buf[at:].view(cache.rope_key.dtype)
    at = 0
    rows: list[list[np.ndarray]] = []
    for count in task.mtp_rows:
        block = values[at : at + count * hidden].reshape(count, hidden).copy()
        rows.append(list(block))
        at += count * hidden
    return MtpState(next_pos=list(task.mtp_next_pos), rows=rows)
