"""Training hyperparameters (torch-free, so the CLI can show the defaults without torch).

The defaults made xds_mpi/data/tiny.h5: 400 steps x 16 windows x 128 tokens = 0.8M tokens (under a
tenth of one pass over the training files), a few minutes on one quiet CPU core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128  # tokens per window seen by the model (plus one target)
    lr: float = 4e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr x this
    warmup_steps: int = 40
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    mtp_weight: float = 0.3  # DeepSeek-V3's lambda
    seed: int = 0
    num_eval_windows: int = 64  # held-out windows for the final loss

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "num_eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.warmup_steps:
            raise ValueError(
                f"need lr > 0 and warmup_steps >= 0, got lr={self.lr}, "
                f"warmup_steps={self.warmup_steps}"
            )

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)
