"""`train_tiny`: AdamW on the main + MTP loss, warmup then cosine, float32, one thread.

Determinism: the weights start from `init_state(seed)`, batches come from a generator seeded
with the same seed, and the loop runs on one intra-op thread, so the result does not depend on
how many cores the machine has. The gate's selection bias stays frozen at zero: DeepSeek-V3 would
nudge it towards balance (auxiliary-loss-free balancing), but the point of this checkpoint is the
skew a router learns on its own (xDeepServe §4.5), which EPLB then has to fix.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xds_mpi.config.schema import ModelConfig
from xds_mpi.model.weights import init_state
from xds_mpi.train.corpus import Corpus, random_windows, spread_windows
from xds_mpi.train.forward import Losses, sequence_losses
from xds_mpi.train.options import TrainConfig
from xds_mpi.train.torch_model import DeepSeekModel


@dataclass(frozen=True, kw_only=True)
class StepReport:
    step: int  # 1-based, after the update
    num_steps: int
    loss: float  # main cross-entropy of this step's batch
    mtp_losses: tuple[float, ...]  # per MTP depth
    tokens_per_s: float
    elapsed_s: float


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    model: DeepSeekModel
    final_loss: float  # main CE, mean of the last 5% of steps (at least one)
    heldout_loss: float  # main CE on the fixed held-out windows
    heldout_mtp_losses: tuple[float, ...]
    wall_s: float
    num_tokens: int


def trainable_model(cfg: ModelConfig, seed: int) -> DeepSeekModel:
    """float32 model with init_state(seed); every parameter trains except the gate bias."""
    model = DeepSeekModel(
        dataclasses.replace(cfg, weights="random", seed=seed), dtype=torch.float32
    )
    model.load_arrays(init_state(model.cfg, seed))
    for name, param in model.named_parameters():
        if name.endswith("gate.bias"):
            param.zero_()
        else:
            param.requires_grad_(True)
    return model


def _param_groups(model: DeepSeekModel, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms and embeddings' scale stay free, the frozen bias is left out."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() == 2 and name != "embed.weight" else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def heldout_losses(
    model: DeepSeekModel, windows: torch.Tensor, *, mtp_weight: float, batch_size: int = 16
) -> tuple[float, tuple[float, ...]]:
    """Mean main and per-depth MTP cross-entropy over windows [n, seq + 1] (equal-size batches
    weigh equally)."""
    main, mtp = [], []
    with torch.no_grad():
        for batch in windows.split(batch_size):
            losses = sequence_losses(model, batch, mtp_weight=mtp_weight)
            main.append(float(losses.main) * len(batch))
            mtp.append([float(m) * len(batch) for m in losses.mtp])
    num = len(windows)
    return sum(main) / num, tuple(sum(col) / num for col in zip(*mtp))


def train_tiny(
    cfg: ModelConfig,
    corpus: Corpus,
    tc: TrainConfig,
    progress: Callable[[StepReport], None] | None = None,
) -> TrainResult:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(cfg, corpus, tc, progress)
    finally:
        torch.set_num_threads(num_threads)


def _train(cfg, corpus, tc, progress) -> TrainResult:
    torch.manual_seed(tc.seed)
    model = trainable_model(cfg, tc.seed)
    model.train()
    optimizer = torch.optim.AdamW(
        _param_groups(model, tc.weight_decay), lr=tc.lr, betas=(0.9, 0.95), foreach=False
    )
    data_gen = torch.Generator().manual_seed(tc.seed)
    tail = max(1, tc.steps // 20)
    tail_losses: list[float] = []
    start = time.perf_counter()
    for step in range(tc.steps):
        batch = random_windows(
            corpus.train, num_windows=tc.batch_size, window_len=tc.seq_len + 1, generator=data_gen
        )
        losses = _update(model, optimizer, batch, tc, step)
        loss = float(losses.main.detach())
        if step >= tc.steps - tail:
            tail_losses.append(loss)
        if progress is not None:
            progress(_step_report(tc, step, loss, losses, time.perf_counter() - start))
    wall_s = time.perf_counter() - start
    heldout, heldout_mtp = _evaluate(model, corpus, tc)
    return TrainResult(
        model=model,
        final_loss=sum(tail_losses) / len(tail_losses),
        heldout_loss=heldout,
        heldout_mtp_losses=heldout_mtp,
        wall_s=wall_s,
        num_tokens=tc.steps * tc.batch_size * tc.seq_len,
    )


def _update(
    model: DeepSeekModel,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    tc: TrainConfig,
    step: int,
) -> Losses:
    """One AdamW step on `batch` [batch_size, seq_len + 1] at the schedule's learning rate, the
    gradient clipped; returns the step's losses."""
    for group in optimizer.param_groups:
        group["lr"] = tc.lr_at(step)
    losses = sequence_losses(model, batch, mtp_weight=tc.mtp_weight)
    optimizer.zero_grad(set_to_none=True)
    losses.total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    optimizer.step()
    return losses


def _step_report(
    tc: TrainConfig, step: int, loss: float, losses: Losses, elapsed: float
) -> StepReport:
    return StepReport(
        step=step + 1,
        num_steps=tc.steps,
        loss=loss,
        mtp_losses=tuple(float(m.detach()) for m in losses.mtp),
        tokens_per_s=(step + 1) * tc.batch_size * tc.seq_len / elapsed,
        elapsed_s=elapsed,
    )


def _evaluate(
    model: DeepSeekModel, corpus: Corpus, tc: TrainConfig
) -> tuple[float, tuple[float, ...]]:
    """Freeze the trained model and measure it on the fixed held-out windows."""
    model.eval()
    model.requires_grad_(False)
    windows = spread_windows(
        corpus.heldout, num_windows=tc.num_eval_windows, window_len=tc.seq_len + 1
    )
    return heldout_losses(model, windows, mtp_weight=tc.mtp_weight)
