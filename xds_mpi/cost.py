"""The 910C cost model: what one operation takes on a die, at the target model's shapes.

Every compute operation is a roofline: max(FLOPs / (peak x compute efficiency), bytes /
(HBM bandwidth x memory efficiency)); the efficiencies are the achieved/peak ratios of the papers'
operator tables (configs/hardware/ascend910c.yaml cites each). GEMMs use INT8 weights and the
INT8 peak; MLA's attention core uses the BF16 peak. Transfers: pull-based dispatch/combine read
the rows over UB (read latency + bytes / read bandwidth); flags are writes (write latency).
Nothing here is fitted to a published end-to-end number.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class Hardware:
    bf16_flops: float  # FLOP/s
    int8_ops: float
    hbm_bytes_per_s: float
    read_bytes_per_s: float  # UB, one die pulling from others
    write_latency_s: float
    read_latency_s: float
    gemm_eff: float
    mla_eff: float
    mem_eff: float
    bubble_s: float  # per iteration scheduling bubble
    weight_bytes: int
    kv_bytes: int
    act_bytes: int

    @classmethod
    def from_profile(cls, p: dict) -> Hardware:
        die, ub, eff, srv = p["die"], p["ub"], p["efficiency"], p["serving"]
        return cls(
            bf16_flops=die["bf16_tflops"] * 1e12,
            int8_ops=die["int8_tops"] * 1e12,
            hbm_bytes_per_s=die["hbm_tb_per_s"] * 1e12,
            read_bytes_per_s=ub["read_gb_per_s_inter"] * 1e9,
            write_latency_s=ub["write_latency_us_inter"] * 1e-6,
            read_latency_s=ub["read_latency_us_inter"] * 1e-6,
            gemm_eff=eff["gemm_int8"],
            mla_eff=eff["mla_compute"],
            mem_eff=eff["memory"],
            bubble_s=srv["scheduler_bubble_ms"] * 1e-3,
            weight_bytes=srv["weight_bytes"],
            kv_bytes=srv["kv_bytes"],
            act_bytes=srv["activation_bytes"],
        )


class CostModel:
    """Seconds per operation for one die at shape `m` on hardware `hw`."""

    def __init__(self, m: ModelConfig, hw: Hardware) -> None:
        self.m, self.hw = m, hw

    def _roofline(self, flops: float, nbytes: float, *, peak: float, eff: float) -> float:
        return max(flops / (peak * eff), nbytes / (self.hw.hbm_bytes_per_s * self.hw.mem_eff))

    def gemm(self, rows: int, params: float) -> float:
        """rows x [in -> out] with `params` = in x out INT8 weights read once."""
        if rows == 0:
            return 0.0
        return self._roofline(
            2.0 * rows * params,
            params * self.hw.weight_bytes,
            peak=self.hw.int8_ops,
            eff=self.hw.gemm_eff,
        )

    # -- attention side -------------------------------------------------------------------------
    def mla_prolog(self, rows: int) -> float:
        """MLAProlog (q/kv down and up projections, the absorbed W_UK) + W_UV and o_proj."""
        m = self.m
        qk = m.qk_nope_dim + m.qk_rope_dim
        params = (
            m.hidden * m.q_lora_rank
            + m.q_lora_rank * m.num_heads * qk
            + m.hidden * (m.kv_lora_rank + m.qk_rope_dim)
            + 2 * m.num_heads * m.qk_nope_dim * m.kv_lora_rank
            + m.num_heads * m.v_head_dim * m.hidden
        )
        return self.gemm(rows, params)

    def attention(self, seqs: list[tuple[int, int]]) -> float:
        """Absorbed MLA: seqs = (KV length, new rows) per sequence; each row scores and reads
        its sequence's latent cache (read once per sequence)."""
        m, width = self.m, self.m.kv_lora_rank + self.m.qk_rope_dim
        flops = sum(2.0 * rows * m.num_heads * n * (width + m.kv_lora_rank) for n, rows in seqs)
        nbytes = sum(n * width * self.hw.kv_bytes for n, _ in seqs)
        return self._roofline(flops, nbytes, peak=self.hw.bf16_flops, eff=self.hw.mla_eff)

    def gate(self, rows: int) -> float:
        return self.gemm(rows, self.m.hidden * self.m.num_routed_experts)

    # -- FFN side -------------------------------------------------------------------------------
    def experts(self, rows_per_expert: list[float]) -> float:
        """SwiGLU experts run one after another on the die, each over its own rows."""
        params = 3.0 * self.m.hidden * self.m.moe_intermediate
        return sum(self.gemm(rows, params) for rows in rows_per_expert if rows > 0)

    def dense_ffn(self, rows: int) -> float:
        return self.gemm(rows, 3.0 * self.m.hidden * self.m.intermediate)

    def head(self, rows: int) -> float:
        return self.gemm(rows, self.m.hidden * self.m.vocab_size)

    def sampling(self, rows: int) -> float:
        """Reading the logits once (argmax / top-p), memory-bound."""
        return rows * self.m.vocab_size * 4 / (self.hw.hbm_bytes_per_s * self.hw.mem_eff)

    # -- transfers ------------------------------------------------------------------------------
    def dispatch(self, rows_in: float, *, int8: bool = True) -> float:
        """Count/offset flags to every peer, then pull `rows_in` rows (INT8 + scale or BF16)."""
        row_bytes = self.m.hidden + 4 if int8 else self.m.hidden * self.hw.act_bytes
        return self._pull(rows_in * row_bytes)

    def combine(self, rows_back: float) -> float:
        """Flags, then pull this die's rows' expert outputs back (BF16)."""
        return self._pull(rows_back * self.m.hidden * self.hw.act_bytes)

    def expert_pull(self) -> float:
        """One routed expert's weights (SwiGLU, weight_bytes each) pulled over the UB from a
        die that hosts it: an EPLB replica load (xds_mpi/eplb)."""
        return self._pull(3.0 * self.m.hidden * self.m.moe_intermediate * self.hw.weight_bytes)

    def _pull(self, nbytes: float) -> float:
        return self.hw.write_latency_s + self.hw.read_latency_s + nbytes / self.hw.read_bytes_per_s
