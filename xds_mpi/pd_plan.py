"""What disaggregated prefill-decode derives from a config (xDeepServe §5.1), for
`xds_mpi.plan.DeploymentPlan.build`: the prefill dies' own expert-parallel group, their
dispatch/combine area, the P/D pairs of the p2p layout, and the refusals of configs PD cannot run.

Prefill dies run their MoE layers with dispatch/combine among themselves (every routed expert
spread over the prefill dies, the shared expert on every prefill die): prefill is compute-bound
and batches many rows per step, so it keeps its own experts instead of joining the decode dies'
lockstep dispatch every decode iteration (that would tie the two phases' step times together,
which is what disaggregation removes).
"""

from __future__ import annotations

from dataclasses import dataclass

from xccl.layout import P2PLayout
from xccl.moe_layout import EpLayout
from xds_mpi.config import Config, ConfigError
from xds_mpi.topology import Topology


@dataclass(frozen=True, kw_only=True)
class PdPlan:
    """prefill: prefill die ranks (prefill DP group g = prefill[g]); decode: the decode DP
    groups' ranks (colocated or attention dies); ep: the prefill dies' dispatch/combine area;
    slot_owner: [routed experts] the prefill rank computing each (phy slot = logical expert)."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    ep: EpLayout
    slot_owner: tuple[int, ...]
    decode_shell: int = 0  # the decode TE-shell's rank: 1 with two host ranks, else the JE (0)

    @property
    def leader(self) -> int:
        """Prefill DP-0: the single-level scheduler's leader."""
        return self.prefill[0]


def build_pd(cfg: Config, topo: Topology, p2p: P2PLayout, itemsize: int) -> PdPlan | None:
    """The PD plan, None when `pd.enabled` is off; refuses what PD cannot run."""
    if not cfg.pd.enabled:
        return None
    prefill = topo.ranks_with_role("prefill")
    decode = topo.ranks_with_role("colocated") + topo.ranks_with_role("attention")
    _refuse(cfg, prefill)
    _refuse_unpaired(cfg, p2p, prefill, decode)
    ep = EpLayout(
        members=prefill,
        base=tuple(p2p.window_bytes(r) for r in range(topo.world_size)),
        hidden=cfg.model.hidden,
        max_tokens=cfg.xccl.max_tokens_per_die,
        num_columns=cfg.model.top_k,
        itemsize=itemsize,
        use_int8=cfg.xccl.use_int8,
    )
    num_experts = cfg.model.num_routed_experts
    base, extra = divmod(num_experts, len(prefill))
    owner = [p for i, p in enumerate(prefill) for _ in range(base + (1 if i < extra else 0))]
    return PdPlan(
        prefill=prefill,
        decode=decode,
        ep=ep,
        slot_owner=tuple(owner),
        decode_shell=1 if cfg.deployment.num_host_ranks == 2 else 0,
    )


def _refuse(cfg: Config, prefill: tuple[int, ...]) -> None:
    dep, model = cfg.deployment, cfg.model
    if dep.num_host_ranks not in (1, 2):
        raise ConfigError(
            f"pd: deployment.num_host_ranks({dep.num_host_ranks}) must be 1 (the JE, which then "
            "balances decode too) or 2 (the JE and the decode TE-shell)"
        )
    if not prefill:
        raise ConfigError(
            "pd.enabled needs prefill dies: deployment.num_prefill_dies(0); "
            "set it to >= 1 (or turn pd.enabled off to prefill on the decode dies)"
        )
    per_die = -(-model.num_routed_experts // len(prefill))
    if per_die > dep.max_routed_experts_per_die:
        raise ConfigError(
            f"model.num_routed_experts({model.num_routed_experts}) do not fit on "
            f"deployment.num_prefill_dies({len(prefill)}) x max_routed_experts_per_die"
            f"({dep.max_routed_experts_per_die})"
        )
    if dep.shared_experts == "dedicated":
        raise ConfigError(
            "pd: prefill dies compute the shared expert locally, so decode's "
            "deployment.shared_experts(dedicated) would round it differently on the wire; "
            "use every_die"
        )
    if dep.kind == "afd" and cfg.xccl.row_dtype != "float64":
        raise ConfigError(
            f"pd with afd decode: A2E sends the shared expert's rows in xccl.row_dtype"
            f"({cfg.xccl.row_dtype}) while prefill computes them locally, so the two phases "
            "would round differently; use row_dtype float64"
        )


def _refuse_unpaired(cfg: Config, p2p: P2PLayout, prefill, decode) -> None:
    """Every prefill die needs a ring into every decode die (any request may go anywhere)."""
    missing = [(p, d) for p in prefill for d in decode if (p, d) not in p2p.pairs]
    if missing:
        p, d = missing[0]
        raise ConfigError(
            f"pd: decode die rank {d} has no p2p pair with prefill die rank {p} "
            f"({len(missing)} of {len(prefill) * len(decode)} prefill->decode pairs missing; "
            f"xccl.p2p_pairs({cfg.xccl.p2p_pairs}) declares {len(p2p.pairs)} pairs); "
            "set xccl.p2p_pairs to prefill_to_decode"
        )


def check_pd_fault(cfg: Config, topo: Topology, i: int, spec) -> bool:
    """A fault-table row of a PD run: p2p rows are KV transfers (ranks/pd_faults.py): p2p_send
    on a prefill die, p2p_recv on a decode die, layer 0, iteration = the die's n-th transfer;
    rows on a prefill die's dispatch/combine would never fire. True when the row is checked."""
    if not cfg.pd.enabled:
        return False
    prefill = topo.ranks_with_role("prefill")
    decode = topo.ranks_with_role("colocated") + topo.ranks_with_role("attention")
    where = f"faults.table[{i}]"
    if not spec.op.startswith("p2p"):
        if spec.die in prefill:
            raise ConfigError(
                f"{where}.die({spec.die}) is a prefill die: its {spec.op} is not fault-injected "
                f"(KV transfers are: op p2p_send on prefill dies {list(prefill)})"
            )
        return False
    dies = prefill if spec.op == "p2p_send" else decode
    if spec.die not in dies:
        side = "prefill" if spec.op == "p2p_send" else "decode"
        raise ConfigError(
            f"{where}: op {spec.op} fails a KV transfer on a {side} die (ranks {list(dies)}), "
            f"not rank {spec.die}"
        )
    if spec.layer != 0:
        raise ConfigError(f"{where}.layer({spec.layer}) must be 0 for a KV transfer (no layers)")
    return True


def pd_window_bytes(cfg: Config, pd: PdPlan | None, windows: tuple[int, ...]) -> tuple[int, ...]:
    """Each rank's window with the prefill dies' dispatch/combine area added, refused over
    xccl.max_window_bytes."""
    if pd is None:
        return windows
    sizes = list(windows)
    for rank in pd.prefill:
        sizes[rank] += pd.ep.area_bytes()
        if sizes[rank] > cfg.xccl.max_window_bytes:
            raise ConfigError(
                f"prefill die rank {rank}'s window needs {sizes[rank]} B = p2p "
                f"{windows[rank]} B + dispatch/combine {pd.ep.area_bytes()} B, over "
                f"xccl.max_window_bytes({cfg.xccl.max_window_bytes})"
            )
    return tuple(sizes)


def describe_pd(plan) -> str:
    """`xds-mpi validate`'s P/D lines: roles, pairs and p2p window bytes per die."""
    pd, p2p = plan.pd, plan.p2p
    lines = [
        f"P/D: JE rank 0; decode TE-shell rank {pd.decode_shell}"
        + (" (the JE)" if pd.decode_shell == 0 else "")
        + f"; prefill DP groups "
        f"{len(pd.prefill)} (ranks {list(pd.prefill)}, leader {pd.leader}); decode "
        f"{plan.cfg.deployment.kind} DP groups ranks {list(pd.decode)}",
        f"p2p: {len(p2p.pairs)} prefill->decode pairs, ring {p2p.ring_slots} x "
        f"{p2p.slot_bytes} B; p2p window bytes: "
        + ", ".join(f"rank {r}: {p2p.window_bytes(r)}" for r in pd.prefill + pd.decode),
    ]
    return "\n".join(lines)
