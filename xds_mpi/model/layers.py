"""Building blocks shared by attention, MoE and MTP: RMSNorm, rotary embedding, SwiGLU FFN."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

NORM_EPS = 1e-6


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
    """Rotary position embedding on the last dim (rotate-half layout) from a precomputed table.

    DeepSeek-V3 extends its context with YaRN; the tiny model's max_seq_len is short enough that
    plain RoPE (theta = rope_theta) is used.
    """

    def __init__(self, *, dim: int, max_seq_len: int, theta: float, dtype: torch.dtype) -> None:
        if dim % 2:
            raise ValueError(f"RoPE needs an even dimension, got qk_rope_dim={dim}")
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        self.max_seq_len = max_seq_len
        self.cos = angles.cos().to(dtype)  # [max_seq_len, dim / 2]
        self.sin = angles.sin().to(dtype)
        # The last positions tensor's (cos, sin) rows: every layer's queries and keys of one
        # forward rotate by the same positions, so the rows are gathered once per forward.
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [rows] int64 -> (cos [rows, dim / 2], sin [rows, dim / 2])"""
        if self._last is None or self._last[0] is not positions:
            if positions.numel() and int(positions.max()) >= self.max_seq_len:
                raise ValueError(
                    f"position {int(positions.max())} is beyond model.max_seq_len"
                    f"({self.max_seq_len})"
                )
            self._last = (positions, self.cos[positions], self.sin[positions])
        return self._last[1], self._last[2]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [rows, ..., dim], positions: [rows] int64 -> x rotated by each row's position."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos, sin = self._rows(positions)
        cos, sin = cos.view(shape), sin.view(shape)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
