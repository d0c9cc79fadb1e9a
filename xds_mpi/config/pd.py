"""The `pd` section: disaggregated prefill-decode (xDeepServe §5.1, docs/design.md "PD").

Part of the config schema (`xds_mpi.config.schema` re-exports it). With `enabled` the prefill dies
(`deployment.num_prefill_dies`) prefill every prompt and hand the latent KV cache to the decode
dies (the colocated or attention dies of `deployment.kind`) over XCCL p2p. What the rest of the
config must hold for that (prefill dies, p2p pairs, window sizes) is `xds_mpi.plan.pd`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.loader import non_negative


@dataclass(frozen=True, kw_only=True)
class PdConfig:
    """enabled: serve with prefill dies and KV transfer (off: prefill dies stay idle).
    long_prompt_tokens: the length-aware split of the prefill leader: prompts of at least this
    many tokens are "long" and never batched with short ones on one prefill DP group
    (0: one class); with 2+ prefill TEs it also splits the TEs into short and long ones.
    num_prefill_tes: how many prefill TEs the prefill dies form (consecutive dies, each TE its own
    scheduler, leader and dispatch/combine group; the JE picks one per request).
    max_transfer_retries: attempts of one KV transfer after a failed one."""

    enabled: bool = False
    long_prompt_tokens: int = 48
    num_prefill_tes: int = 1
    max_transfer_retries: int = 3

    def __post_init__(self) -> None:
        non_negative(
            "pd",
            long_prompt_tokens=self.long_prompt_tokens,
            max_transfer_retries=self.max_transfer_retries,
        )
