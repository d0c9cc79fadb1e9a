"""The `scaling` section: what a scale-out event costs on the 910C clock (DeepServe §6, its
Table 2's five steps; CloudMatrix-Infer §4.4.3 model caching; docs/scaling.md).

Part of the config schema (`xds_mpi.config.schema` re-exports it). xds_mpi/scaling/steps.py
`scale_out` reads it to price the five steps of one scale event. Every figure below names its
source: [001] CloudMatrix-Infer (arXiv 2506.12708), [002] DeepServe (USENIX ATC'25), or
"assumption" (no source publishes it; stated so it can change, docs/scaling.md says why each
default is what it is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import non_negative, positive, require

LOAD_PATHS = ("fork", "dram", "cold", "ems")


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """path: where TE-Load takes the weights from ([002] §6.2, [001] §4.4.3): "fork" from a
    serving TE's dies over the UB (NPU-fork), "dram" from the host's DRAM page cache over PCIe
    (DRAM-hit), "cold" from object storage (OBS), then over PCIe, "ems" from the EMS pool over
    the UB (model caching).
    prewarmed_pods: a pod is waiting, Scaler-Pre costs nothing ([002] §6.1).
    prewarmed_tes: a started TE (runtime imported, NPU and communicators set up) is waiting,
    TE-Pre-Load costs nothing ([002] §6.1).
    parallel_init: late imports and parallel initialization shorten TE-Pre-Load by
    `parallel_init_saving` ([002] §6.1: "approximately 35%").
    offline_profiling: the KV size comes from an offline profile, blocks are allocated
    asynchronously and one dummy request warms the TE, instead of the engine's warm-up run
    ([002] §6, Table 2 row 4).
    proactive_push: the cluster manager pushes the new TE list to the JEs, instead of the JEs
    polling it every `te_list_poll_s` ([002] Table 2 row 5).
    ems_cached: the EMS pool already holds the model; else one OBS fetch fills it first, shared
    by every loader ([001] §4.4.3).
    fork_fanout: how many receivers each sender of an NPU-fork feeds at once: 1 is a pipelined
    chain (each new TE forwards what it got, the source sends the weights once), N the source
    feeding all N itself (its link shared N ways)."""

    path: Literal["fork", "dram", "cold", "ems"] = "dram"
    prewarmed_pods: bool = True
    prewarmed_tes: bool = True
    parallel_init: bool = True
    offline_profiling: bool = True
    proactive_push: bool = True
    ems_cached: bool = True
    fork_fanout: int = 1
    # Step 1, Scaler-Pre: creating the pod(s) that hold the TE.
    pod_create_s: float = 10.0  # assumption: a pod scheduled and its container started
    # Step 2, TE-Pre-Load: the engine started without its model ([002] §6.1 lists the three).
    python_startup_s: float = 20.0  # assumption: Python and the engine's libraries imported
    npu_init_s: float = 10.0  # assumption: NPU runtime and device memory set up
    comm_init_s: float = 5.0  # assumption: the collective-communication domains joined
    parallel_init_saving: float = 0.35  # [002] §6.1: "approximately 35%"
    # Step 3, TE-Load.
    tensor_init_s: float = 0.3  # [002] §6.2: model tensor initialization "about 0.3s"
    pcie_gb_per_s: float = 32.0  # assumption: PCIe Gen4 x16 nominal per NPU (8 per node ~256
    #                              GB/s, [001] §4.1's "PCIe at ~256 GB/s"); shared by its dies
    obs_gb_per_s: float = 2.5  # [001] Table 2: the OBS bucket's bandwidth
    obs_efficiency: float = 0.84  # fitted: [001] Table 2's EMS cold start (~320 s for one
    #                               fetch of 671 GB); `xds-mpi project --scaling` prints the fit
    pool_nodes: int = 32  # [001] §5.1: the EMS pool is the DRAM of 32 compute nodes
    pool_node_gb_per_s: float = 640.0  # [001] §3.3.2: 4 Kunpeng sockets x ~160 GB/s UB each
    fork_chunk_mb: float = 64.0  # assumption: the broadcast's pipeline block
    # Step 4, TE-Post-Load.
    warmup_s: float = 20.0  # assumption: the engine's warm-up run that sizes the KV cache
    block_alloc_s: float = 2.0  # assumption: CPU/NPU KV blocks allocated before serving
    dummy_request_s: float = 0.1  # assumption: one dummy request through the new TE
    # Step 5, Scaler-Post.
    push_s: float = 0.01  # assumption: one control message from the cluster manager
    te_list_poll_s: float = 10.0  # assumption: a JE's poll period (a TE waits half, on average)
    # The source TE during a fork: its UB link's share the fork takes while both send.
    fork_link_share: float = 0.5  # assumption: two streams on one link, an even split

    def __post_init__(self) -> None:
        require(
            self.path in LOAD_PATHS,
            f"scaling.path must be one of {', '.join(LOAD_PATHS)}, got {self.path!r}",
        )
        positive(
            "scaling",
            fork_fanout=self.fork_fanout,
            pcie_gb_per_s=self.pcie_gb_per_s,
            obs_gb_per_s=self.obs_gb_per_s,
            obs_efficiency=self.obs_efficiency,
            pool_nodes=self.pool_nodes,
            pool_node_gb_per_s=self.pool_node_gb_per_s,
            fork_chunk_mb=self.fork_chunk_mb,
            te_list_poll_s=self.te_list_poll_s,
        )
        non_negative(
            "scaling",
            pod_create_s=self.pod_create_s,
            python_startup_s=self.python_startup_s,
            npu_init_s=self.npu_init_s,
            comm_init_s=self.comm_init_s,
            tensor_init_s=self.tensor_init_s,
            warmup_s=self.warmup_s,
            block_alloc_s=self.block_alloc_s,
            dummy_request_s=self.dummy_request_s,
            push_s=self.push_s,
        )
        for key in ("parallel_init_saving", "fork_link_share"):
            value = getattr(self, key)
            require(0 <= value < 1, f"scaling.{key} must be in [0, 1), got {value}")
        require(
            self.obs_efficiency <= 1,
            f"scaling.obs_efficiency must be <= 1, got {self.obs_efficiency}",
        )
