"""The accuracy an INT8 checkpoint pays, measured against its float original on held-out text
(CloudMatrix-Infer §5.3 compares INT8 DeepSeek-R1 with the unquantized model; the tiny model has
no benchmarks, so its measures are the language model's own).

Teacher-forced over held-out windows: next-token cross-entropy and perplexity; greedy (top-1)
agreement with the float model at every position; MTP acceptance: the depth-1 draft at i (fed
the true token i + 1) equals the model's own greedy token at i + 1; routing: the mean share of a
row's top-k experts the float model also picked, over every MoE layer (MTP's included).
Generated from held-out prompts with MTP depth 1 (ReferenceGenerator, the dies' path): the share
of generated tokens equal to the float model's at the same position, and drafts accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.transformer import DeepSeekModel
from xds_mpi.quant.sites import blocks, forward_windows


@dataclass(frozen=True, kw_only=True)
class Measures:
    """One model on the evaluation text."""

    name: str
    cross_entropy: float  # nats per token
    perplexity: float
    top1_agreement: float  # teacher-forced greedy tokens equal to the float model's
    mtp_acceptance: float  # teacher-forced depth-1 drafts equal to the model's next greedy token
    routing_overlap: float  # |top-k ∩ float top-k| / k, mean over rows and MoE layers
    generated_agreement: float  # generated tokens equal to the float model's, same position
    generated_acceptance: float  # MTP drafts accepted / drafted while generating


@dataclass(frozen=True, kw_only=True)
class _Run:
    logits: np.ndarray  # [b, t, vocab]
    mtp_logits: np.ndarray  # [b, t - 1, vocab]
    routing: list[np.ndarray]  # per MoE layer: [b * t, top_k] (MTP's: [b * (t - 1), top_k])
    generated: list[tuple[int, ...]]
    num_drafted: int
    num_accepted: int


class _GateRecorder:
    def __init__(self, gate, log: list) -> None:
        self.gate, self.log = gate, log

    def __call__(self, x):
        routing = self.gate(x)
        self.log.append(routing.topk_idx)
        return routing


def _run(
    model: DeepSeekModel, windows: np.ndarray, prompts, new_tokens: int, kv_int8: bool
) -> _Run:
    logs = []
    for _, block in blocks(model):
        if block.is_moe:
            logs.append([])
            block.ffn.gate = _GateRecorder(block.ffn.gate, logs[-1])
    logits, mtp_logits = forward_windows(model, windows, kv_int8=kv_int8)
    routing = [np.concatenate(log) for log in logs]
    for _, block in blocks(model):
        if block.is_moe:
            block.ffn.gate = block.ffn.gate.gate
    options = GenerateOptions(
        max_new_tokens=new_tokens, mtp_depth=1 if model.mtp else 0, ignore_eos=True, kv_int8=kv_int8
    )
    outputs = ReferenceGenerator(model, options).generate(prompts)
    return _Run(
        logits=logits,
        mtp_logits=mtp_logits,
        routing=routing,
        generated=[o.tokens for o in outputs],
        num_drafted=sum(o.num_drafted for o in outputs),
        num_accepted=sum(o.num_accepted for o in outputs),
    )


def _cross_entropy(logits: np.ndarray, windows: np.ndarray) -> float:
    """Mean -log p(token i + 1 | tokens <= i) over every window position."""
    pred = logits[:, :-1]  # [b, t - 1, vocab]
    shifted = pred - pred.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, windows[:, 1:, None], axis=-1)
    return float(-picked.mean())


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """a, b: [rows, k] expert ids -> mean |a_row ∩ b_row| / k"""
    same = (a[:, :, None] == b[:, None, :]).any(-1)  # [rows, k]
    return float(same.mean())


def _measures(name: str, run: _Run, ref: _Run, windows: np.ndarray) -> Measures:
    ce = _cross_entropy(run.logits, windows)
    greedy = run.logits.argmax(-1)  # [b, t]
    drafts = run.mtp_logits.argmax(-1)  # [b, t - 1]: draft for position i + 2
    mtp = float((drafts[:, :-1] == greedy[:, 1:-1]).mean()) if drafts.size else float("nan")
    gen_same = [
        np.mean(np.array(g[: len(f)]) == np.array(f[: len(g)]))
        for g, f in zip(run.generated, ref.generated)
    ]
    return Measures(
        name=name,
        cross_entropy=ce,
        perplexity=float(np.exp(ce)),
        top1_agreement=float((greedy == ref.logits.argmax(-1)).mean()),
        mtp_acceptance=mtp,
        routing_overlap=float(np.mean([_overlap(a, b) for a, b in zip(run.routing, ref.routing)])),
        generated_agreement=float(np.mean(gen_same)),
        generated_acceptance=run.num_accepted / max(1, run.num_drafted),
    )


def evaluate(
    models: dict[str, tuple[DeepSeekModel, bool]],
    windows: np.ndarray,
    prompts: list[list[int]],
    *,
    reference: str,
    new_tokens: int,
) -> list[Measures]:
    """models: name -> (model, INT8 latent KV or not) (`reference` is the float one); windows:
    [b, t] held-out token ids; prompts: held-out prompts to generate `new_tokens` from -> one
    Measures per model."""
    runs = {
        name: _run(model, windows, prompts, new_tokens, kv_int8)
        for name, (model, kv_int8) in models.items()
    }
    return [_measures(name, run, runs[reference], windows) for name, run in runs.items()]


def format_table(rows: list[Measures]) -> str:
    header = (
        f"{'model':<14} {'CE nats':>8} {'ppl':>7} {'top-1 agree':>11} {'MTP accept':>10} "
        f"{'routing':>8} {'gen agree':>9} {'gen accept':>10}"
    )
    lines = [header, "-" * len(header)]
    for m in rows:
        lines.append(
            f"{m.name:<14} {m.cross_entropy:>8.4f} {m.perplexity:>7.3f} {m.top1_agreement:>11.2%} "
            f"{m.mtp_acceptance:>10.2%} {m.routing_overlap:>8.2%} {m.generated_agreement:>9.2%} "
            f"{m.generated_acceptance:>10.2%}"
        )
    return "\n".join(lines)
