"""What a die's latent KV cache costs, float vs INT8 latent (scheduler.kv_int8, xDeepServe
§4.7), here and at the cost shape; `xds-mpi validate` prints it.

Per token and cache layer: the latent c_kv (kv_lora_rank values) and the RoPE key (qk_rope_dim
values); INT8 keeps c_kv as one byte per value plus a float32 scale per token, the RoPE key as
before. Emulated: the compute dtype (8 bytes for float64); cost shape: BF16 (2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.schema import Config, ModelConfig

SCALE_BYTES = 4  # one float32 scale per token and layer


def token_layer_bytes(model: ModelConfig, *, itemsize: int, kv_int8: bool) -> int:
    """One token's KV in one cache layer."""
    latent = model.kv_lora_rank + SCALE_BYTES if kv_int8 else model.kv_lora_rank * itemsize
    return latent + model.qk_rope_dim * itemsize


def projected_kv_bytes(prompt_len: int, big, *, kv_int8: bool = False) -> int:
    """Bytes of a prompt's latent cache at the cost shape, MTP layers included: every layer's
    kv_lora_rank + qk_rope_dim per token in BF16, or (kv_int8) the latent as INT8 + a float32
    scale and the RoPE key in BF16."""
    per_token = token_layer_bytes(big, itemsize=2, kv_int8=kv_int8)
    return (big.num_layers + big.num_mtp_modules) * prompt_len * per_token


@dataclass(frozen=True, kw_only=True)
class KvMemory:
    """A die's KV pool with float and with INT8 latents."""

    num_cache_layers: int
    float_token_bytes: int  # every cache layer, compute dtype
    int8_token_bytes: int
    pool_bytes: int  # num_kv_blocks_per_die blocks as configured (kv_int8 or not)
    num_blocks: int  # configured
    same_bytes_blocks: int  # blocks the other layout fits in pool_bytes
    blocks_per_request: int  # for the workload's prompt_len + output_len (+ MTP drafts)
    cost_float_bytes: int  # one token, one layer at the cost shape, BF16
    cost_int8_bytes: int

    @classmethod
    def of(cls, cfg: Config, cost: ModelConfig, *, itemsize: int = 8) -> KvMemory:
        sched, model = cfg.scheduler, cfg.model
        layers = model.num_layers + sched.mtp_depth
        per = {
            q: layers * token_layer_bytes(model, itemsize=itemsize, kv_int8=q)
            for q in (False, True)
        }
        block_bytes = {q: per[q] * sched.kv_block_tokens for q in per}
        pool = sched.num_kv_blocks_per_die * block_bytes[sched.kv_int8]
        tokens = cfg.workload.prompt_len + cfg.workload.output_len + sched.mtp_depth + 1
        return cls(
            num_cache_layers=layers,
            float_token_bytes=per[False],
            int8_token_bytes=per[True],
            pool_bytes=pool,
            num_blocks=sched.num_kv_blocks_per_die,
            same_bytes_blocks=pool // block_bytes[not sched.kv_int8],
            blocks_per_request=-(-tokens // sched.kv_block_tokens),
            cost_float_bytes=token_layer_bytes(cost, itemsize=2, kv_int8=False),
            cost_int8_bytes=token_layer_bytes(cost, itemsize=2, kv_int8=True),
        )


def describe_kv(cfg: Config, cost: ModelConfig) -> str:
    kv = KvMemory.of(cfg, cost)
    is_int8 = cfg.scheduler.kv_int8
    here, other = ("INT8", "float") if is_int8 else ("float", "INT8")
    blocks = {here: kv.num_blocks, other: kv.same_bytes_blocks}
    requests = {k: v // kv.blocks_per_request for k, v in blocks.items()}
    return (
        f"KV cache ({here} latent, scheduler.kv_int8={str(is_int8).lower()}): "
        f"{kv.float_token_bytes} B/token float64 vs {kv.int8_token_bytes} B/token INT8 latent "
        f"over {kv.num_cache_layers} cache layers; a die's {kv.pool_bytes / 2**20:.2f} MiB pool "
        f"holds {blocks['float']} blocks float / {blocks['INT8']} INT8 = "
        f"{requests['float']} / {requests['INT8']} requests of "
        f"{kv.blocks_per_request} blocks; cost shape, per token and layer: "
        f"{kv.cost_float_bytes} B BF16 vs {kv.cost_int8_bytes} B INT8 latent "
        f"({kv.cost_float_bytes / kv.cost_int8_bytes:.2f}x the tokens in the same HBM)"
    )
