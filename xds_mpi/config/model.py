"""The `model` section: the compute shape of the tiny DeepSeek-style model that actually runs.

Part of the config schema (`xds_mpi.config.schema` re-exports it). Its checks are the model's own:
sizes, layer counts and the group-limited routing of DeepSeek-V3 (top-k experts from the
top-k groups); what a model shape implies for the dies is `xds_mpi.plan.deployment`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.loader import non_negative, positive, require


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Compute shape of the tiny DeepSeek-style model that actually runs."""

    vocab_size: int = 260  # byte-level: 256 bytes + special tokens
    hidden: int = 128
    num_layers: int = 4
    num_dense_layers: int = 1  # the first layers use a dense FFN
    num_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_dim: int = 16
    qk_rope_dim: int = 8
    v_head_dim: int = 16
    intermediate: int = 256  # dense FFN
    moe_intermediate: int = 64  # one routed or shared expert
    num_routed_experts: int = 16
    num_shared_experts: int = 1
    top_k: int = 2
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 2.5
    num_mtp_modules: int = 1
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    weights: str = "random"  # "random" (from seed), "tiny" (packaged) or an HDF5 path
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_layers()
        self._check_routing()

    def _check_sizes(self) -> None:
        s = "model"
        positive(
            s,
            vocab_size=self.vocab_size,
            hidden=self.hidden,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_dim=self.qk_nope_dim,
            qk_rope_dim=self.qk_rope_dim,
            v_head_dim=self.v_head_dim,
            intermediate=self.intermediate,
            moe_intermediate=self.moe_intermediate,
            num_routed_experts=self.num_routed_experts,
            top_k=self.top_k,
            num_expert_groups=self.num_expert_groups,
            topk_groups=self.topk_groups,
            routed_scaling=self.routed_scaling,
            max_seq_len=self.max_seq_len,
            rope_theta=self.rope_theta,
        )
        non_negative(
            s,
            num_dense_layers=self.num_dense_layers,
            num_shared_experts=self.num_shared_experts,
            num_mtp_modules=self.num_mtp_modules,
        )

    def _check_layers(self) -> None:
        require(
            self.num_dense_layers < self.num_layers,
            f"model.num_dense_layers"
            f"({self.num_dense_layers}) must be < model.num_layers({self.num_layers})",
        )
        require(
            self.num_mtp_modules <= 2,
            f"model.num_mtp_modules must be 0, 1 or 2, got {self.num_mtp_modules}",
        )

    def _check_routing(self) -> None:
        """Group-limited routing: top_k experts out of the topk_groups best expert groups."""
        require(
            self.top_k <= self.num_routed_experts,
            f"model.top_k({self.top_k}) must be <= "
            f"model.num_routed_experts({self.num_routed_experts})",
        )
        require(
            self.num_routed_experts % self.num_expert_groups == 0,
            f"model.num_routed_experts({self.num_routed_experts}) must be a multiple of "
            f"model.num_expert_groups({self.num_expert_groups})",
        )
        require(
            self.topk_groups <= self.num_expert_groups,
            f"model.topk_groups({self.topk_groups})"
            f" must be <= model.num_expert_groups({self.num_expert_groups})",
        )
        per_group = self.num_routed_experts // self.num_expert_groups
        require(
            self.top_k <= self.topk_groups * per_group,
            f"model.top_k({self.top_k}) must be <= topk_groups({self.topk_groups}) x experts "
            f"per group({per_group})",
        )
