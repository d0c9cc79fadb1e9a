"""The `pd` section: disaggregated prefill-decode (xDeepServe §5.1, docs/design.md "PD").

Part of the config schema (`xds_mpi.config.schema` re-exports it). With `enabled` the prefill dies
(`deployment.num_prefill_dies`) prefill every prompt and hand the latent KV cache to the decode
dies (the colocated or attention dies of `deployment.kind`) over XCCL p2p. What the rest of the
config must hold for that (prefill dies, p2p pairs, window sizes) is `xds_mpi.plan.pd`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import non_negative, require


@dataclass(frozen=True, kw_only=True)
class PdConfig:
    """enabled: serve with prefill dies and KV transfer (off: prefill dies stay idle).
    long_prompt_tokens: the length-aware split of the prefill leader: prompts of at least this
    many tokens are "long" and never batched with short ones on one prefill DP group
    (0: one class); with 2+ prefill TEs it also splits the TEs into short and long ones.
    num_prefill_tes: how many prefill TEs the prefill dies form (consecutive dies, each TE its own
    scheduler, leader and dispatch/combine group; the JE picks one per request).
    max_transfer_retries: attempts of one KV transfer after a failed one.
    prefill_profile: the prefill dies' hardware profile (configs/hardware/; "" = hardware.profile);
    a prefill die of another hardware than the decode dies sits outside their UB domain
    (xDeepServe §5.1: 910B prefill, 910C decode), so its KV crosses `kv_fabric`.
    kv_fabric: the fabric of such a pair (§5.1: "RoCE or VPC"; xds_mpi/plan/kv_link.py).
    prefill_microbatches: 2 splits each prefill step's batch into two microbatches pipelined on
    two streams, one's dispatch/combine overlapping the other's attention (CloudMatrix-Infer
    §4.3.2; the mechanism is the two-stream decode's, xds_mpi/execution/two_streams.py)."""

    enabled: bool = False
    long_prompt_tokens: int = 48
    num_prefill_tes: int = 1
    max_transfer_retries: int = 3
    prefill_profile: str = ""
    kv_fabric: Literal["roce", "vpc"] = "roce"
    prefill_microbatches: int = 1

    def __post_init__(self) -> None:
        non_negative(
            "pd",
            long_prompt_tokens=self.long_prompt_tokens,
            max_transfer_retries=self.max_transfer_retries,
        )
        require(
            self.prefill_microbatches in (1, 2),
            "pd.prefill_microbatches must be 1 or 2 (2: CloudMatrix-Infer §4.3.2's microbatch "
            f"prefill pipeline, a microbatch per stream), got {self.prefill_microbatches}",
        )
