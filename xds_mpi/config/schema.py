"""Deployment configuration schema: keyword-only frozen dataclasses, one per section.

A config file has the sections below (every key optional, defaults shown in the dataclasses;
`model`, `faults`, `health`, `eplb`, `pd`, `trace`, `ems`, `emulator`, `serve`, `cluster`,
`autoscaler` and `scaling` are declared in `xds_mpi/config/*.py` modules); each section checks
its own constraints, naming the numbers involved. Reading YAML, `--set` overrides, unknown keys
and value types are `xds_mpi.config.loader`'s. What a config implies across sections (rank map,
layouts, window sizes) and whether it can run is `xds_mpi.plan.deployment.DeploymentPlan`'s,
never written back into the config.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from xds_mpi.config.autoscaler import AutoscalerConfig
from xds_mpi.config.cluster import ClusterConfig
from xds_mpi.config.ems import EmsConfig
from xds_mpi.config.emulator import EmulatorConfig

# FAULT_OPS, FaultSpec, ModelConfig, ConfigError, check_value and parse_override are
# re-exported: callers import the whole config interface from here.
from xds_mpi.config.eplb import EplbConfig
from xds_mpi.config.failures import FAILURE_KINDS, FailureSpec, HealthConfig  # noqa: F401
from xds_mpi.config.faults import FAULT_OPS, FaultsConfig, FaultSpec  # noqa: F401
from xds_mpi.config.loader import (  # noqa: F401
    ConfigError,
    build_root,
    check_value,
    non_negative,
    parse_override,
    positive,
    read_root,
    require,
)
from xds_mpi.config.model import ModelConfig
from xds_mpi.config.pd import PdConfig
from xds_mpi.config.scaling import ScalingConfig
from xds_mpi.config.serve import ServeConfig
from xds_mpi.config.trace import TraceConfig


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig:
    """Which dies play which role. Dies are numbered after the host ranks."""

    kind: Literal["colocated", "afd"] = "colocated"
    num_host_ranks: int = 1  # TE-shell + frontend; CPU processes, no die
    num_dp_domains: int = 1  # colocated: exactly 1
    dp_groups_per_domain: int = 4  # attention dies per DP domain (TP=1: one die per DP group)
    num_expert_dies: int = 0  # afd: dies running only the MoE (incl. dedicated shared)
    shared_experts: Literal["every_die", "dedicated"] = "every_die"
    num_shared_expert_dies: int = 0  # dedicated: expert-hosting dies holding a shared expert
    redundant_slots_per_die: int = 0  # EPLB replica slots on each routed-expert die
    max_routed_experts_per_die: int = 64
    num_prefill_dies: int = 0  # PD disaggregation: dies that only prefill
    num_microbatches: int = 1  # afd: per DP domain; colocated: 2 = two-stream decode
    # PD: dies per prefill DP group, attention heads split among them (xds_mpi/plan/pd.py)
    prefill_tp: int = 1

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_kind()
        self._check_shared_experts()

    def _check_counts(self) -> None:
        s = "deployment"
        non_negative(
            s,
            num_host_ranks=self.num_host_ranks,
            num_expert_dies=self.num_expert_dies,
            num_shared_expert_dies=self.num_shared_expert_dies,
            redundant_slots_per_die=self.redundant_slots_per_die,
            num_prefill_dies=self.num_prefill_dies,
        )
        positive(
            s,
            num_dp_domains=self.num_dp_domains,
            dp_groups_per_domain=self.dp_groups_per_domain,
            max_routed_experts_per_die=self.max_routed_experts_per_die,
            num_microbatches=self.num_microbatches,
        )
        require(
            self.prefill_tp in (1, 2, 4),
            "deployment.prefill_tp must be 1, 2 or 4 (dies per prefill DP group, xDeepServe "
            f"§5.1's prefill TEs run TP=4), got {self.prefill_tp}",
        )

    def _check_kind(self) -> None:
        """What a colocated deployment cannot have, and what an afd one needs."""
        if self.kind == "colocated":
            require(
                self.num_dp_domains == 1,
                "deployment.num_dp_domains must be 1 for a "
                "colocated deployment (every die meets the experts every layer), got "
                f"{self.num_dp_domains}",
            )
            require(
                self.num_expert_dies == 0,
                "deployment.num_expert_dies must be 0 for a "
                "colocated deployment (experts live on the attention dies), got "
                f"{self.num_expert_dies}",
            )
            require(
                self.num_microbatches in (1, 2),
                "deployment.num_microbatches must be 1 or 2 for a colocated deployment (2: the "
                "two-stream decode of CloudMatrix-Infer §4.2.3, one microbatch per stream), got "
                f"{self.num_microbatches}",
            )
        else:
            require(
                self.num_expert_dies >= self.dp_groups_per_domain,
                "deployment: an afd deployment needs one trampoline expert die per attention "
                f"die of a domain: num_expert_dies({self.num_expert_dies}) < "
                f"dp_groups_per_domain({self.dp_groups_per_domain})",
            )

    def _check_shared_experts(self) -> None:
        if self.shared_experts == "every_die":
            require(
                self.num_shared_expert_dies == 0,
                "deployment.num_shared_expert_dies must be "
                f"0 when shared_experts is every_die, got {self.num_shared_expert_dies}",
            )
        else:
            require(
                self.num_shared_expert_dies > 0,
                "deployment.num_shared_expert_dies must be "
                "> 0 when shared_experts is dedicated, got 0",
            )

    @property
    def num_attention_dies(self) -> int:
        return self.num_dp_domains * self.dp_groups_per_domain


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Per-DP-group limits of the decode scheduler."""

    max_batch_per_die: int = 8
    kv_block_tokens: int = 16
    num_kv_blocks_per_die: int = 256
    prefill_chunk_tokens: int = 64
    mtp_depth: int = 0  # MTP draft tokens per decode step (0 = plain decoding)
    kv_int8: bool = False  # latent KV's non-RoPE part as INT8 + a per-token scale (§4.7)

    def __post_init__(self) -> None:
        positive(
            "scheduler",
            max_batch_per_die=self.max_batch_per_die,
            kv_block_tokens=self.kv_block_tokens,
            num_kv_blocks_per_die=self.num_kv_blocks_per_die,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
        )
        require(
            self.mtp_depth in (0, 1, 2),
            f"scheduler.mtp_depth must be 0, 1 or 2, got {self.mtp_depth}",
        )


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """The request stream the TE-shell's frontend serves."""

    source: Literal["synthetic", "jsonl", "trace"] = "synthetic"  # trace: the `trace` section
    path: str = ""  # jsonl: one {"prompt": ..., "max_tokens": ...} per line
    num_requests: int = 8
    arrival: Literal["all_at_once", "rate"] = "all_at_once"
    rate_per_s: float = 0.0
    length_dist: Literal["fixed", "uniform", "long_tail"] = "fixed"
    prompt_len: int = 32
    output_len: int = 16
    max_prompt_len: int = 64  # uniform / long_tail upper bound
    max_output_len: int = 32
    ignore_eos: bool = False  # generate max_new_tokens even past EOS (fixed lengths)
    seed: int = 0

    def __post_init__(self) -> None:
        s = "workload"
        positive(
            s,
            num_requests=self.num_requests,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
        )
        require(
            self.max_prompt_len >= self.prompt_len,
            f"workload.max_prompt_len"
            f"({self.max_prompt_len}) must be >= workload.prompt_len({self.prompt_len})",
        )
        require(
            self.max_output_len >= self.output_len,
            f"workload.max_output_len"
            f"({self.max_output_len}) must be >= workload.output_len({self.output_len})",
        )
        require(
            self.arrival != "rate" or self.rate_per_s > 0,
            f"workload.rate_per_s must be > 0 when arrival is rate, got {self.rate_per_s}",
        )
        require(
            self.source != "jsonl" or bool(self.path),
            "workload.path must name a JSONL file when source is jsonl",
        )


@dataclass(frozen=True, kw_only=True)
class XcclConfig:
    """Static sizes of XCCL's managed areas and its waiting behaviour."""

    ring_slots: int = 8  # S: slots per p2p ring
    slot_bytes: int = 65536  # B: bytes per ring slot
    p2p_pairs: Literal["none", "all", "prefill_to_decode"] = "none"
    max_tokens_per_die: int = 64  # dispatch/combine and A2E/E2A rows per die and step
    use_int8: bool = True
    row_dtype: Literal["float64", "float32"] = "float64"  # dispatch/combine rows without INT8
    num_cores: int = 2  # AIV cores a transfer is split over
    poll_timeout_s: float = 60.0  # every wait raises after this long
    max_window_bytes: int = 1 << 30  # per-die cap on the RMA window
    # "auto": load/store to the same-node peers MPI exposes, else RMA; "rma": RMA (gmem_paths)
    memory_path: Literal["auto", "rma"] = "auto"
    wait: Literal["auto", "sleep", "spin"] = "auto"  # xccl/wake.py; why auto: docs/mpi.md §4

    def __post_init__(self) -> None:
        positive(
            "xccl",
            ring_slots=self.ring_slots,
            slot_bytes=self.slot_bytes,
            max_tokens_per_die=self.max_tokens_per_die,
            num_cores=self.num_cores,
            poll_timeout_s=self.poll_timeout_s,
            max_window_bytes=self.max_window_bytes,
        )


@dataclass(frozen=True, kw_only=True)
class HardwareConfig:
    """The pod being emulated: its shape and the cost profile (configs/hardware/<profile>.yaml)."""

    profile: str = "ascend910c"
    dies_per_chip: int = 2
    chips_per_server: int = 8
    servers_per_pod: int = 48

    def __post_init__(self) -> None:
        positive(
            "hardware",
            dies_per_chip=self.dies_per_chip,
            chips_per_server=self.chips_per_server,
            servers_per_pod=self.servers_per_pod,
        )

    @property
    def dies_per_server(self) -> int:
        return self.dies_per_chip * self.chips_per_server

    @property
    def dies_per_pod(self) -> int:
        return self.dies_per_server * self.servers_per_pod


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How a launch behaves and where it writes."""

    output_dir: str = "runs"
    name: str = ""  # run file name (no .h5); "" = derived from the start time
    log_level: Literal["debug", "info", "warning"] = "info"
    timeout_s: float = 600.0  # MPIEXEC_TIMEOUT for the whole job
    check: bool = False  # compare with the single-process reference
    trace: bool = True  # write <run name>.trace.json beside the run file (xds_mpi/report/trace.py)
    seed: int = 0
    # The SLOs a request must meet to count in the goodput, on the projected clock (xDeepServe:
    # "a TTFT SLA under 2 s and a TPOT SLA of 35 ms"; xds_mpi/results/slo.py)
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 35.0
    # Which clock drives serving (arrivals, queueing, admission, the DP balancer): "virtual",
    # the dies' 910C clock with idle time skipped (docs/virtual_time.md); "wall", this machine's;
    # "auto", virtual where it is built (a colocated `xds-mpi run`), else wall
    # (xds_mpi/plan/clock.py)
    clock: Literal["auto", "virtual", "wall"] = "auto"

    def __post_init__(self) -> None:
        positive(
            "run",
            timeout_s=self.timeout_s,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
        )
        require(
            "/" not in self.name and self.name not in (".", ".."),
            f"run.name must be a file name without '/', got {self.name!r}",
        )


@dataclass(frozen=True, kw_only=True)
class Config:
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    xccl: XcclConfig = field(default_factory=XcclConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    pd: PdConfig = field(default_factory=PdConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    ems: EmsConfig = field(default_factory=EmsConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    run: RunConfig = field(default_factory=RunConfig)
    emulator: EmulatorConfig = field(default_factory=EmulatorConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def config_from_dict(data: dict | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Build a Config from a parsed YAML mapping plus `section.key=value` overrides."""
    return build_root(Config, data, overrides)


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML deployment file and apply `--set` overrides."""
    return read_root(Config, path, overrides)
