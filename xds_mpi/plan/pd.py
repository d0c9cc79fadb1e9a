"""What disaggregated prefill-decode derives from a config (xDeepServe §5.1), for
`xds_mpi.plan.deployment.DeploymentPlan.build`: the prefill dies' own expert-parallel group, their
dispatch/combine area, the P/D pairs of the p2p layout, and the refusals of configs PD cannot run.

The prefill dies form `pd.num_prefill_tes` prefill TEs of consecutive dies (sizes differing by
at most one, the first TEs the larger). A TE is self-contained: its own single-level scheduler
with its leader at its DP-0, and its own expert-parallel group.
Prefill dies run their MoE layers with dispatch/combine among their TE's dies (every routed
expert spread over them, the shared expert on every prefill die): prefill is compute-bound
and batches many rows per step, so it keeps its own experts instead of joining the decode dies'
lockstep dispatch every decode iteration (that would tie the two phases' step times together,
which is what disaggregation removes).

With `deployment.prefill_tp` > 1 a prefill DP group is that many consecutive dies of one TE (a
TP group): rows and attention heads split among them, exchanged with xccl/tp_gather.py, whose
area follows the dispatch/combine area in each of their windows (xds_mpi/execution/prefill_tp.py).
The group's first die is its leader: it reports the group's status to the TE's scheduler and
sends its KV to decode.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xccl.layout import P2PLayout
from xccl.moe_layout import EpLayout
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.plan.topology import Topology

if TYPE_CHECKING:  # imported where PD runs: every rank builds the plan, most without PD
    from xccl.tp_gather import TpLayout


@dataclass(frozen=True, kw_only=True)
class PdPlan:
    """prefill: prefill die ranks (one prefill DP group each); tes: those ranks per prefill TE;
    decode: the decode DP groups' ranks (colocated or attention dies); eps: each TE's
    dispatch/combine area; slot_owners: per TE, [routed experts] the TE's rank computing each
    (phy slot = logical expert)."""

    prefill: tuple[int, ...]
    tes: tuple[tuple[int, ...], ...]
    decode: tuple[int, ...]
    eps: tuple[EpLayout, ...]
    slot_owners: tuple[tuple[int, ...], ...]
    decode_shell: int = 0  # the decode TE-shell's rank: 1 with two host ranks, else the JE (0)
    tp: int = 1
    tp_layouts: tuple[TpLayout, ...] = ()

    @property
    def leaders(self) -> tuple[int, ...]:
        """Each TE's DP-0: its single-level scheduler's leader, which also plays its TE-shell."""
        return tuple(te[0] for te in self.tes)

    def te_of(self, rank: int) -> int:
        return next(t for t, te in enumerate(self.tes) if rank in te)

    def tp_group_of(self, rank: int) -> tuple[int, ...]:
        """The prefill DP group (TP group) of prefill die `rank`: its dies, leader first."""
        te = self.tes[self.te_of(rank)]
        start = te.index(rank) // self.tp * self.tp
        return te[start : start + self.tp]

    def tp_layout_of(self, rank: int) -> TpLayout:
        return next(t for t in self.tp_layouts if rank in t.members)


def build_pd(cfg: Config, topo: Topology, p2p: P2PLayout, itemsize: int) -> PdPlan | None:
    """The PD plan, None when `pd.enabled` is off; refuses what PD cannot run."""
    if not cfg.pd.enabled:
        if cfg.deployment.prefill_tp > 1:
            raise ConfigError(
                f"deployment.prefill_tp({cfg.deployment.prefill_tp}) needs pd.enabled: without "
                "PD the decode dies prefill, one die per DP group"
            )
        return None
    prefill = topo.ranks_with_role("prefill")
    decode = topo.ranks_with_role("colocated") + topo.ranks_with_role("attention")
    _refuse(cfg, prefill)
    _refuse_tp(cfg, prefill)
    _refuse_unpaired(cfg, p2p, prefill, decode)
    from xds_mpi.plan.kv_link import (
        check_kv_links,  # start-up: only PD runs (tests/unit/launch/test_rank_imports.py)
    )

    check_kv_links(cfg, topo, prefill, decode)
    tes = split(prefill, cfg.pd.num_prefill_tes)
    eps = tuple(
        EpLayout(
            members=te,
            base=tuple(p2p.window_bytes(r) for r in range(topo.world_size)),
            hidden=cfg.model.hidden,
            max_tokens=cfg.xccl.max_tokens_per_die,
            num_columns=cfg.model.top_k,
            itemsize=itemsize,
            use_int8=cfg.xccl.use_int8,
            num_lanes=cfg.pd.prefill_microbatches,  # a lane per microbatch (two_streams.py)
        )
        for te in tes
    )
    return PdPlan(
        prefill=prefill,
        tes=tes,
        decode=decode,
        eps=eps,
        slot_owners=tuple(split_experts(cfg.model.num_routed_experts, te) for te in tes),
        decode_shell=1 if cfg.deployment.num_host_ranks == 2 else 0,
        tp=cfg.deployment.prefill_tp,
        tp_layouts=tp_layouts(cfg, topo, p2p, tes, eps),
    )


def tp_layouts(cfg: Config, topo: Topology, p2p: P2PLayout, tes, eps) -> tuple[TpLayout, ...]:
    """Each TP group's exchange area, after the p2p and dispatch/combine areas of its windows.
    A slot holds the largest piece of a die's share of a step's rows (max_tokens / tp): their
    down-projected latents (q_lora_rank + kv_lora_rank + qk_rope_dim), a die's heads of their
    attention output (heads / tp x kv_lora_rank) or the rows themselves (hidden), in float64
    (the model's widest dtype; xds_mpi/execution/prefill_tp.py)."""
    tp, model = cfg.deployment.prefill_tp, cfg.model
    if tp == 1:
        return ()
    # start-up: only prefill TP (tests/unit/launch/test_rank_imports.py)
    from xccl.tp_gather import TpLayout

    share = -(-cfg.xccl.max_tokens_per_die // tp)
    down = model.q_lora_rank + model.kv_lora_rank + model.qk_rope_dim
    heads = (model.num_heads // tp) * model.kv_lora_rank
    slot_bytes = 8 * share * max(down, heads, model.hidden)
    layouts = []
    for te, ep in zip(tes, eps):
        base = tuple(
            p2p.window_bytes(r) + (ep.area_bytes() if r in te else 0)
            for r in range(topo.world_size)
        )
        for start in range(0, len(te), tp):
            layouts.append(
                TpLayout(members=te[start : start + tp], base=base, slot_bytes=slot_bytes)
            )
    return tuple(layouts)


def split(ranks: tuple[int, ...], num: int) -> tuple[tuple[int, ...], ...]:
    """`num` runs of consecutive ranks whose sizes differ by at most one, the first the larger."""
    base, extra = divmod(len(ranks), num)
    starts = [i * base + min(i, extra) for i in range(num + 1)]
    return tuple(ranks[starts[i] : starts[i + 1]] for i in range(num))


def split_experts(num_experts: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The rank of `ranks` computing each routed expert: contiguous chunks, sizes within one."""
    chunks = split(tuple(range(num_experts)), len(ranks))
    return tuple(r for r, chunk in zip(ranks, chunks) for _ in chunk)


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
    num_tes = cfg.pd.num_prefill_tes
    if not 1 <= num_tes <= len(prefill):
        raise ConfigError(
            f"pd.num_prefill_tes({num_tes}) must be between 1 and deployment.num_prefill_dies"
            f"({len(prefill)}): each prefill TE needs at least one prefill die"
        )
    smallest = len(prefill) // num_tes  # a TE's dies hold every routed expert between them
    if -(-model.num_routed_experts // smallest) > dep.max_routed_experts_per_die:
        raise ConfigError(
            f"model.num_routed_experts({model.num_routed_experts}) do not fit on the smallest "
            f"prefill TE: deployment.num_prefill_dies({len(prefill)}) / pd.num_prefill_tes"
            f"({num_tes}) = {smallest} dies x max_routed_experts_per_die"
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


def _refuse_tp(cfg: Config, prefill: tuple[int, ...]) -> None:
    """What prefill TP groups (deployment.prefill_tp dies each) need, with the numbers."""
    tp, model = cfg.deployment.prefill_tp, cfg.model
    if tp == 1:
        return
    if model.num_heads % tp:
        raise ConfigError(
            f"deployment.prefill_tp({tp}) must divide model.num_heads({model.num_heads}): "
            "each die of a prefill DP group computes the same number of attention heads"
        )
    sizes = [len(te) for te in split(prefill, cfg.pd.num_prefill_tes)]
    if any(size % tp for size in sizes):
        raise ConfigError(
            f"deployment.prefill_tp({tp}) must divide every prefill TE's dies: "
            f"deployment.num_prefill_dies({len(prefill)}) / pd.num_prefill_tes"
            f"({cfg.pd.num_prefill_tes}) gives TEs of {sizes} dies; use a multiple of "
            f"{tp * cfg.pd.num_prefill_tes} prefill dies"
        )
    if cfg.ems.enabled:
        raise ConfigError(
            f"deployment.prefill_tp({tp}) with ems.enabled: the EMS prefix pull is per die, "
            "not per TP group, here; use prefill_tp 1 with the EMS pool"
        )
    lost = [i for i, s in enumerate(cfg.faults.events) if s.die in prefill]
    if lost:
        raise ConfigError(
            f"faults.events[{lost[0]}] hits prefill die rank {cfg.faults.events[lost[0]].die}: "
            f"losing one die of a prefill TP group (deployment.prefill_tp({tp})) is not "
            "handled; use prefill_tp 1"
        )
    leaders = prefill[::tp]
    for i, spec in enumerate(cfg.faults.table):
        if spec.op == "p2p_send" and spec.die in prefill and spec.die not in leaders:
            raise ConfigError(
                f"faults.table[{i}].die({spec.die}) sends no KV: with deployment.prefill_tp"
                f"({tp}) only each TP group's leader does (ranks {list(leaders)})"
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
    """A fault-table row of a PD run: p2p rows are KV transfers (ranks/pd/faults.py): p2p_send
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
        area = pd.eps[pd.te_of(rank)].area_bytes()
        gather = pd.tp_layout_of(rank).area_bytes() if pd.tp > 1 else 0
        sizes[rank] += area + gather
        if sizes[rank] > cfg.xccl.max_window_bytes:
            raise ConfigError(
                f"prefill die rank {rank}'s window needs {sizes[rank]} B = p2p "
                f"{windows[rank]} B + dispatch/combine {area} B + tp gather {gather} B, over "
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
        f"{len(pd.prefill) // pd.tp} (ranks {list(pd.prefill)}, "
        + (f"TP{pd.tp} groups {[list(t.members) for t in pd.tp_layouts]}, " if pd.tp > 1 else "")
        + (f"leader {pd.leaders[0]}" if len(pd.tes) == 1 else f"{len(pd.tes)} prefill TEs")
        + f"); decode "
        f"{plan.cfg.deployment.kind} DP groups ranks {list(pd.decode)}",
        *describe_tes(plan.cfg, pd),
        f"p2p: {len(p2p.pairs)} prefill->decode pairs, ring {p2p.ring_slots} x "
        f"{p2p.slot_bytes} B; p2p window bytes: "
        + ", ".join(f"rank {r}: {p2p.window_bytes(r)}" for r in pd.prefill + pd.decode),
        describe_kv_links(plan),
    ]
    return "\n".join(lines)


def describe_kv_links(plan) -> str:
    """The KV fabric of the prefill->decode pairs (xds_mpi/plan/kv_link.py), by class."""
    from xds_mpi.plan.kv_link import die_profile, kv_link_class  # start-up, as in build_pd

    cfg, topo, pd = plan.cfg, plan.topo, plan.pd
    classes = Counter(kv_link_class(cfg, topo, p, d) for p in pd.prefill for d in pd.decode)
    return (
        f"KV links: prefill dies on {die_profile(cfg, topo, pd.prefill[0])}, decode dies on "
        f"{cfg.hardware.profile}; "
        + ", ".join(f"{n} pairs over {c}" for c, n in sorted(classes.items()))
    )


def serves_long(te: int, num_tes: int) -> bool:
    return te >= num_tes - num_tes // 2


def describe_tes(cfg: Config, pd: PdPlan) -> list[str]:
    """One line per prefill TE when there are several: its dies, leader and length class."""
    if len(pd.tes) < 2:
        return []
    long_tokens = cfg.pd.long_prompt_tokens
    return [
        f"prefill TE {t}: ranks {list(te)}, leader (its TE-shell) {te[0]}, EP{len(te)}, "
        + (
            "any prompt"
            if not long_tokens
            else f"prompts of {'>=' if serves_long(t, len(pd.tes)) else '<'} {long_tokens} tokens"
        )
        for t, te in enumerate(pd.tes)
    ]
