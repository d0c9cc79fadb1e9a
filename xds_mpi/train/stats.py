"""What a checkpoint does on held-out text: routed-expert load, MTP acceptance, perplexity.

Expert load counts, per MoE layer, the rows the gate sends to each routed expert (top_k per
token). xDeepServe §4.5 reports the hottest expert at ~30x the average on real traffic; EPLB's
replicas are sized from exactly this distribution.

MTP acceptance is measured two ways (xDeepServe §4.6 reports 70-90 % for DeepSeek's module):
- teacher-forced, per module k: on the text, the share of positions i where module k's greedy
  draft of t_{i+k+1} equals the main model's greedy choice for that token given t_0..t_{i+k};
  this is exactly the greedy verify test when the text is what was committed;
- greedy decoding with the reference generator (num_accepted / num_drafted) from held-out
  prompts, where the committed tokens are the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from xds_mpi.model import transformer
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.train.forward import sequence_logits
from xds_mpi.train.torch_model import DeepSeekModel, Gate


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    layer: str  # "layer 1" (main model block index) or "mtp 1"
    counts: tuple[int, ...]  # [num_routed_experts] rows routed to each expert

    @property
    def mean(self) -> float:
        return sum(self.counts) / len(self.counts)

    @property
    def max_over_mean(self) -> float:
        return max(self.counts) / self.mean

    @property
    def share_above_mean(self) -> float:
        return sum(c > self.mean for c in self.counts) / len(self.counts)


@dataclass(frozen=True, kw_only=True)
class TextStats:
    """Teacher-forced measures over windows [n, seq] of held-out text."""

    loss: float  # mean main cross-entropy (nats per token)
    expert_loads: tuple[ExpertLoad, ...]
    mtp_acceptance: tuple[float, ...]  # per MTP module, teacher-forced

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def _moe_gates(model: DeepSeekModel) -> dict[str, Gate]:
    gates = {
        f"layer {idx}": layer.ffn.gate for idx, layer in enumerate(model.layers) if layer.is_moe
    }
    gates.update({f"mtp {k}": module.block.ffn.gate for k, module in enumerate(model.mtp, 1)})
    return gates


def text_stats(model: DeepSeekModel, windows: torch.Tensor, *, batch_size: int = 8) -> TextStats:
    """windows: [n, seq] int64 -> loss, expert loads and teacher-forced MTP acceptance."""
    gates = _moe_gates(model)
    num_experts = model.cfg.num_routed_experts
    counts = {name: torch.zeros(num_experts, dtype=torch.int64) for name in gates}

    def count_hook(name: str):
        def hook(module, inputs, routing) -> None:
            counts[name] += torch.bincount(routing[0].flatten(), minlength=num_experts)

        return hook

    handles = [gate.register_forward_hook(count_hook(name)) for name, gate in gates.items()]
    loss_sum, num_agree, num_drafts = 0.0, [0] * len(model.mtp), [0] * len(model.mtp)
    try:
        with torch.no_grad():
            for batch in windows.split(batch_size):
                out = sequence_logits(model, batch[:, :-1])
                loss_sum += float(
                    F.cross_entropy(out.main.flatten(0, 1), batch[:, 1:].flatten())
                ) * len(batch)
                main_choice = out.main.argmax(-1)  # [b, seq]: greedy choice of t_{i+1}
                for k, logits in enumerate(out.mtp, start=1):
                    # Module k's row i drafts t_{i+k+1}; the main model's row i+k chooses it.
                    agree = logits.argmax(-1) == main_choice[:, k:]
                    num_agree[k - 1] += int(agree.sum())
                    num_drafts[k - 1] += agree.numel()
    finally:
        for handle in handles:
            handle.remove()
    return TextStats(
        loss=loss_sum / len(windows),
        expert_loads=tuple(
            ExpertLoad(layer=name, counts=tuple(c.tolist())) for name, c in counts.items()
        ),
        mtp_acceptance=tuple(a / n for a, n in zip(num_agree, num_drafts)),
    )


@dataclass(frozen=True, kw_only=True)
class DecodeAcceptance:
    mtp_depth: int
    num_drafted: int
    num_accepted: int
    num_tokens: int
    num_steps: int

    @property
    def rate(self) -> float:
        return self.num_accepted / max(1, self.num_drafted)


def decode_acceptance(
    model: DeepSeekModel, prompts: list[list[int]], *, mtp_depth: int, max_new_tokens: int
) -> DecodeAcceptance:
    """Greedy decoding of every prompt with MTP depth `mtp_depth` in the reference generator
    (the numpy model the dies serve, with the torch model's weights)."""
    options = GenerateOptions(max_new_tokens=max_new_tokens, mtp_depth=mtp_depth, ignore_eos=True)
    served = transformer.DeepSeekModel(model.cfg, model.arrays())
    outs = ReferenceGenerator(served, options).generate(prompts)
    return DecodeAcceptance(
        mtp_depth=mtp_depth,
        num_drafted=sum(o.num_drafted for o in outs),
        num_accepted=sum(o.num_accepted for o in outs),
        num_tokens=sum(len(o.tokens) for o in outs),
        num_steps=sum(o.num_steps for o in outs),
    )
