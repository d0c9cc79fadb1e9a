"""The torch twin of the numpy model (xds_mpi/model/): what `xds-mpi train-tiny` trains, and the
tests' independent oracle. Same tensor names as the checkpoint (`param_shapes`), same formulas;
no cache and no XCCL wire: the training forward (xds_mpi/train/forward.py) runs whole sequences
with MLA un-absorbed. The dies never import this module (tests/e2e/cli/test_no_torch.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.layers import NORM_EPS
from xds_mpi.model.weights import check_names, init_state, read_weights
from xds_mpi.train.grouped import grouped_swiglu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim]"""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def linear(in_dim: int, out_dim: int) -> nn.Linear:
    return nn.Linear(in_dim, out_dim, bias=False)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): the dense FFN, one routed expert and the shared expert(s)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = linear(hidden, intermediate)
        self.w3 = linear(hidden, intermediate)
        self.w2 = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden] -> [rows, hidden]"""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Rotary:
    """Plain RoPE (rotate-half layout) from a precomputed table, as xds_mpi/model/layers.py."""

    def __init__(self, *, dim: int, max_seq_len: int, theta: float) -> None:
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()  # [max_seq_len, dim / 2]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [rows, ..., dim], positions: [rows] int64 -> x rotated by each row's position."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos = self.cos[positions].to(x.dtype).view(shape)
        sin = self.sin[positions].to(x.dtype).view(shape)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qk_nope_dim, self.qk_rope_dim = cfg.qk_nope_dim, cfg.qk_rope_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.rotary = rotary
        self.scale = (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5
        qk_head_dim = cfg.qk_nope_dim + cfg.qk_rope_dim
        self.wq_a = linear(cfg.hidden, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank)
        self.wq_b = linear(cfg.q_lora_rank, cfg.num_heads * qk_head_dim)
        self.wkv_a = linear(cfg.hidden, cfg.kv_lora_rank + cfg.qk_rope_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank)
        self.wkv_b = linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_dim + cfg.v_head_dim))
        self.wo = linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden)

    def project_q(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [n, hidden] -> (q_nope [n, heads, qk_nope_dim], q_rope [n, heads, qk_rope_dim])"""
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(x.shape[0], self.num_heads, -1)
        q_nope, q_rope = q.split([self.qk_nope_dim, self.qk_rope_dim], dim=-1)
        return q_nope, self.rotary(q_rope, positions)

    def project_latent(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [n, hidden] -> (c_kv [n, kv_lora_rank], k_rope [n, rope])"""
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_dim], dim=-1)
        return self.kv_norm(c_kv), self.rotary(k_rope, positions)


def select_experts(scores: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig):
    """DeepSeek-V3 routing (xds_mpi/model/moe.py's, in torch) -> (topk_idx, topk_weight)."""
    num_rows, num_experts = scores.shape
    biased = scores + bias
    if cfg.num_expert_groups > 1:
        grouped = biased.view(num_rows, cfg.num_expert_groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        group_idx = group_scores.topk(cfg.topk_groups, dim=-1).indices
        is_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        biased = grouped.masked_fill(~is_kept[..., None], -torch.inf).view(num_rows, num_experts)
    topk_idx = biased.topk(cfg.top_k, dim=-1).indices
    weight = scores.gather(1, topk_idx)
    return topk_idx, weight / weight.sum(-1, keepdim=True) * cfg.routed_scaling


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_routed_experts, cfg.hidden))
        self.bias = nn.Parameter(torch.zeros(cfg.num_routed_experts))

    def forward(self, x: torch.Tensor):
        """x: [rows, hidden] -> (topk_idx [rows, top_k], topk_weight [rows, top_k])"""
        return select_experts(torch.sigmoid(x @ self.weight.T), self.bias, self.cfg)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.hidden, cfg.moe_intermediate) for _ in range(cfg.num_routed_experts)
        )
        self.shared_experts = nn.ModuleList(
            SwiGLU(cfg.hidden, cfg.moe_intermediate) for _ in range(cfg.num_shared_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden] normalized rows -> [rows, hidden]"""
        topk_idx, topk_weight = self.gate(x)
        out = torch.zeros_like(x)
        for expert in self.shared_experts:
            out = out + expert(x)
        routed = grouped_swiglu(x, topk_idx, self.experts)  # [rows, top_k, hidden]
        return out + (topk_weight[..., None] * routed).sum(1)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, *, is_moe: bool) -> None:
        super().__init__()
        self.is_moe = is_moe
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = MLA(cfg, rotary)
        self.ffn_norm = RMSNorm(cfg.hidden)
        self.ffn = MoE(cfg) if is_moe else SwiGLU(cfg.hidden, cfg.intermediate)

    def ffn_part(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] residual stream -> [n, hidden] after the FFN / MoE residual."""
        return x + self.ffn(self.ffn_norm(x))


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.hnorm = RMSNorm(cfg.hidden)
        self.enorm = RMSNorm(cfg.hidden)
        self.eh_proj = linear(2 * cfg.hidden, cfg.hidden)
        self.block = Block(cfg, rotary, is_moe=True)
        self.norm = RMSNorm(cfg.hidden)


class DeepSeekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(dim=cfg.qk_rope_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(
            Block(cfg, self.rotary, is_moe=i >= cfg.num_dense_layers) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden)
        self.head = linear(cfg.hidden, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTPModule(cfg, self.rotary) for _ in range(cfg.num_mtp_modules))
        self.to(dtype)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] -> [..., vocab_size]"""
        return self.head(self.norm(hidden))

    def mtp_module(self, depth: int) -> MTPModule:
        """Depth k uses module k; deeper reuses the last one (as the numpy model)."""
        return self.mtp[min(depth, len(self.mtp)) - 1]

    def mtp_logits(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.mtp_module(depth).norm(hidden))

    def load_arrays(self, state: dict[str, np.ndarray]) -> None:
        """Every parameter from numpy arrays named as the checkpoint names them."""
        check_names(self.cfg, state, "torch model")
        self.load_state_dict({name: torch.from_numpy(np.asarray(v)) for name, v in state.items()})

    def arrays(self) -> dict[str, np.ndarray]:
        """Every parameter as a float32 numpy array (what `save_weights` stores)."""
        return {n: t.detach().to(torch.float32).numpy() for n, t in self.state_dict().items()}


def random_torch_model(cfg: ModelConfig, seed: int, *, dtype=torch.float64) -> DeepSeekModel:
    """The twin of `build_model` for random weights: the same seeded values."""
    model = DeepSeekModel(cfg, dtype=dtype)
    model.load_arrays(init_state(cfg, seed))
    return model


def load_torch_model(path: str | Path, *, dtype=torch.float64) -> DeepSeekModel:
    """A checkpoint file as the torch twin (its own config)."""
    cfg, tensors = read_weights(path)
    model = DeepSeekModel(cfg, dtype=dtype)
    model.load_arrays(tensors)
    return model
