"""The KV bytes a PD-transfer task (xds_mpi/engine/pd_task.py) moves (xDeepServe §5.1 steps
6-8): packed only when the decode die asks for them (it posted its irecv), and unpacked into the
decode die's own slots.

Exactness: the message is the prefill die's latent cache rows copied bit for bit (float64 in,
float64 out: `pack_kv` views the tensors' bytes, `unpack_kv` writes the same values into the
decode die's slots), so decode attends over exactly the KV it would have computed itself; the
MTP rows (h^k of positions not yet consumed) travel the same way.
"""

from __future__ import annotations

import numpy as np

from xds_mpi.engine.mtp import MtpState
from xds_mpi.engine.pd_task import PdTask
from xds_mpi.model.mla import LatentCache


def kv_nbytes(task: PdTask, cache: LatentCache, hidden: int) -> int:
    """Bytes of the task's message: every cache layer's latent + rope key rows, then MTP rows."""
    layers, _, lora = cache.latent.shape
    rope = cache.rope_key.shape[2]
    itemsize = cache.latent.itemsize
    return itemsize * (layers * task.kv_len * (lora + rope) + sum(task.mtp_rows) * hidden)


def pack_kv(task: PdTask, cache: LatentCache, mtp: MtpState | None) -> np.ndarray:
    """The task's message as one contiguous byte array (a copy: the blocks stay untouched)."""
    slots = np.array(task.slots, dtype=np.int64)
    parts = [cache.latent[:, slots].reshape(-1), cache.rope_key[:, slots].reshape(-1)]
    if mtp is not None:
        parts += [row.reshape(-1) for rows in mtp.rows for row in rows]
    return np.concatenate(parts).view(np.uint8)


def unpack_kv(
    task: PdTask, buf: np.ndarray, cache: LatentCache, slots: list[int], hidden: int
) -> MtpState | None:
    """Write the message into `cache` at the decode die's `slots`; the MTP state, if any."""
    values = buf.view(cache.latent.dtype)
    layers, _, lora = cache.latent.shape
    rope, n = cache.rope_key.shape[2], task.kv_len
    index = np.array(slots, dtype=np.int64)
    at = layers * n * lora
    cache.latent[:, index] = values[:at].reshape(layers, n, lora)
    cache.rope_key[:, index] = values[at : at + layers * n * rope].reshape(layers, n, rope)
    if not task.mtp_next_pos:
        return None
    at += layers * n * rope
    rows: list[list[np.ndarray]] = []
    for count in task.mtp_rows:
        block = values[at : at + count * hidden].reshape(count, hidden).copy()
        rows.append(list(block))
        at += count * hidden
    return MtpState(next_pos=list(task.mtp_next_pos), rows=rows)


def projected_kv_bytes(prompt_len: int, big) -> int:
    """Bytes of a prompt's latent cache at the cost shape (BF16): every layer's
    kv_lora_rank + qk_rope_dim per token, MTP layers included."""
    per_token = (big.kv_lora_rank + big.qk_rope_dim) * 2
    return (big.num_layers + big.num_mtp_modules) * prompt_len * per_token
