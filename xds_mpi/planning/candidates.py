"""The deployments a chip budget holds (docs/planning.md, "What is enumerated").

A Candidate names its shape in the repo's config keys (`sets`), so each one is a runnable
config; `enumerate_candidates` returns those that fit and, for the others, why not (memory,
a config check the repo itself makes, or seed 003's AFD dead zone)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product

from xds_mpi.config.schema import ConfigError, ModelConfig
from xds_mpi.planning.memory import ModelBytes, die_memory, experts_per_die

KINDS = ("colocated", "pd", "afd")
DECODE_EP = (16, 32, 64, 128, 256, 288)  # 288: the paper's 256 routed + 32 shared dies (§7.1)
AFD_ATTENTION = (16, 32, 64, 160)  # attention dies per DP domain (160: Figure 18)
AFD_EXPERT = (32, 64, 128, 288)
PREFILL_TES = (1, 2, 4, 8)
PREFILL_TP = (1, 4)  # §7.2: DP8 over 32 dies, TP4
SHARED_DIES = 32  # §7.1 / Figure 18: 32 dies hold the shared expert beside 256 routed


@dataclass(frozen=True, kw_only=True)
class Options:
    """The axes beside the shapes: MTP depths, INT8 KV on/off, batch limits per DP group (of
    which each shape keeps the largest that fits in memory), redundant slots per routed-expert
    die (tried at 256+ routed dies only, where §7.1 uses them; with uniform expert loads they
    only cost memory, so not tried by default), AFD microbatches, dies per prefill TE."""

    mtp_depths: tuple[int, ...] = (0, 1)
    kv_int8: tuple[bool, ...] = (False, True)
    max_batches: tuple[int, ...] = (16, 32, 64, 96)
    redundant: tuple[int, ...] = (0,)
    afd_microbatches: tuple[int, ...] = (2,)
    prefill_te_dies: tuple[int, ...] = (32,)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One deployment. decode_dies: the dies that decode (afd: attention + expert dies);
    prefill_dies: PD's prefill dies (num_prefill_tes x prefill_te_dies); sets: the config keys
    that make it (over configs/ep288.yaml's model), `key=value` strings."""

    kind: str
    decode_dies: int
    prefill_dies: int
    num_prefill_tes: int
    prefill_tp: int
    mtp_depth: int
    kv_int8: bool
    max_batch: int
    sets: tuple[str, ...] = field(default=())
    label: str = ""

    @property
    def num_dies(self) -> int:
        return self.decode_dies + self.prefill_dies

    def chips(self, dies_per_chip: int) -> float:
        return self.num_dies / dies_per_chip

    @property
    def prefill_te_dies(self) -> int:
        return self.prefill_dies // max(1, self.num_prefill_tes)

    def decode_sets(self) -> tuple[str, ...]:
        """The keys of the decode side alone: what the projection prices."""
        return tuple(
            s
            for s in self.sets
            if not s.startswith(
                ("pd.", "deployment.num_prefill", "deployment.prefill_tp", "deployment.num_host")
            )
        )


@dataclass(frozen=True, kw_only=True)
class Excluded:
    label: str
    reason: str


def _colocated_sets(ep: int, redundant: int) -> tuple[list[str], int, int]:
    """(sets, routed dies, dies) of a colocated EP group: 288 is 256 routed + 32 shared."""
    if ep == 288:
        routed = ep - SHARED_DIES
        sets = [
            "deployment.shared_experts=dedicated",
            f"deployment.num_shared_expert_dies={SHARED_DIES}",
        ]
    else:
        routed = ep
        sets = ["deployment.shared_experts=every_die", "deployment.num_shared_expert_dies=0"]
    sets += [
        "deployment.kind=colocated",
        "deployment.num_dp_domains=1",
        f"deployment.dp_groups_per_domain={ep}",
        "deployment.num_expert_dies=0",
        f"deployment.redundant_slots_per_die={redundant}",
    ]
    return sets, routed, ep


def _afd_sets(
    attention: int, domains: int, experts: int, microbatches: int, redundant: int
) -> tuple[list[str], int, int, int]:
    shared = SHARED_DIES if experts == 288 else 0
    sets = [
        "deployment.kind=afd",
        f"deployment.num_dp_domains={domains}",
        f"deployment.dp_groups_per_domain={attention}",
        f"deployment.num_expert_dies={experts}",
        "deployment.shared_experts=" + ("dedicated" if shared else "every_die"),
        f"deployment.num_shared_expert_dies={shared}",
        f"deployment.num_microbatches={microbatches}",
        f"deployment.redundant_slots_per_die={redundant}",
    ]
    return sets, experts - shared, attention * domains + experts, redundant


class Enumerator:
    """Builds and checks candidates for one budget: num_dies, the profile's HBM per die, the
    workload's context (tokens a batch slot holds) and longest prompt."""

    def __init__(
        self,
        m: ModelConfig,
        *,
        num_dies: int,
        hbm: float,
        weight_bytes: float,
        context_len: int,
        max_prompt: int,
        dead_zone=None,
        count_prefill: bool = True,
    ) -> None:
        self.m, self.mb = m, ModelBytes.of(m)
        self.num_dies, self.hbm, self.weight_bytes = num_dies, hbm, weight_bytes
        self.context_len, self.max_prompt = context_len, max_prompt
        self.dead_zone = dead_zone  # expert dies -> reason (seed 003), or None
        self.count_prefill = count_prefill  # False: the budget holds the decode dies only
        self.kept: list[Candidate] = []
        self.excluded: list[Excluded] = []

    def run(self, kinds: tuple[str, ...], opts: Options) -> None:
        for kind in kinds:
            if kind not in KINDS:
                raise ConfigError(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
        decode = []
        if "colocated" in kinds or "pd" in kinds:
            decode += [
                ("colocated", *self._colocated(ep, r))
                for ep in DECODE_EP
                for r in opts.redundant
                if r == 0 or ep >= 256
            ]
        if "afd" in kinds:
            decode += [
                ("afd", *_afd_sets(a, d, e, mb, r))
                for a, d, e, mb in product(
                    AFD_ATTENTION, (1, 2, 3), AFD_EXPERT, opts.afd_microbatches
                )
                for r in opts.redundant
                if r == 0 or e >= 256
            ]
        prefill = [(0, 0, 1)] + [
            (k, p, tp) for k, p, tp in product(PREFILL_TES, opts.prefill_te_dies, PREFILL_TP)
        ]
        if not self.count_prefill:  # decode only: one prefill shape stands for all
            prefill = prefill[:2]
        for (decode_kind, sets, routed, dies, redundant), (k, p, tp) in product(decode, prefill):
            kind = "pd" if decode_kind == "colocated" and k else decode_kind
            if kind not in kinds or (kind == "afd" and not k):
                continue  # afd decodes behind PD's prefill TEs (configs/pd_afd.yaml)
            for mtp, kv8 in product(opts.mtp_depths, opts.kv_int8):
                self._largest(kind, sets, routed, dies, redundant, k, p, tp, mtp, kv8, opts=opts)

    def _largest(self, *shape, opts: Options) -> None:
        """The largest batch limit that fits; when none does, the smallest's reason."""
        excluded = len(self.excluded)
        for batch in sorted(opts.max_batches, reverse=True):
            if self._consider(*shape, batch):
                del self.excluded[excluded:]
                return
        del self.excluded[excluded:-1]

    def _colocated(self, ep: int, redundant: int):
        sets, routed, dies = _colocated_sets(ep, redundant)
        return sets, routed, dies, redundant

    def _consider(self, kind, sets, routed, dies, redundant, k, p, tp, mtp, kv8, batch) -> bool:
        """Keep the candidate (True) or record why not (False)."""
        label = _label(kind, sets, dies, k, p, tp, mtp, kv8, batch)
        if dies + (k * p if self.count_prefill else 0) > self.num_dies:
            return True  # over budget: not a candidate at all, not worth a line
        full = [
            *sets,
            f"scheduler.mtp_depth={mtp}",
            f"scheduler.kv_int8={str(kv8).lower()}",
            f"scheduler.max_batch_per_die={batch}",
        ]
        if k:
            full += [
                "pd.enabled=true",
                "deployment.num_host_ranks=2",
                f"deployment.num_prefill_dies={k * p}",
                f"deployment.prefill_tp={tp}",
            ]
        cand = Candidate(
            kind=kind,
            decode_dies=dies,
            prefill_dies=k * p,
            num_prefill_tes=k,
            prefill_tp=tp,
            mtp_depth=mtp,
            kv_int8=kv8,
            max_batch=batch,
            sets=tuple(full),
            label=label,
        )
        reason = self._why_not(cand, routed, redundant)
        if reason:
            self.excluded.append(Excluded(label=label, reason=reason))
        else:
            self.kept.append(cand)
        return not reason

    def _why_not(self, c: Candidate, routed: int, redundant: int) -> str:
        """'' when c fits; else the first reason it does not."""
        if c.prefill_tp > 1 and c.prefill_te_dies % c.prefill_tp:
            return (
                f"prefill TE of {c.prefill_te_dies} dies is not a whole number of "
                f"TP{c.prefill_tp} groups"
            )
        slots = experts_per_die(self.m.num_routed_experts, routed) + redundant
        kv_tokens = c.max_batch * self.context_len
        shared_here = 1 if not any("dedicated" in s for s in c.sets) else 0
        if c.kind == "afd":
            checks = [
                die_memory(
                    self.mb,
                    role="attention",
                    hbm=self.hbm,
                    weight_bytes=self.weight_bytes,
                    has_attention=True,
                    experts=0,
                    kv_tokens=kv_tokens,
                    kv_int8=c.kv_int8,
                ),
                die_memory(
                    self.mb,
                    role="expert",
                    hbm=self.hbm,
                    weight_bytes=self.weight_bytes,
                    has_attention=False,
                    experts=slots + shared_here,
                    kv_tokens=0,
                    kv_int8=c.kv_int8,
                ),
            ]
            attention = _key(c.sets, "deployment.dp_groups_per_domain")
            experts = _key(c.sets, "deployment.num_expert_dies")
            if experts < attention:
                return (
                    f"afd needs one trampoline expert die per attention die of a domain: "
                    f"expert dies {experts} < attention dies per domain {attention}"
                )
            if self.dead_zone is not None and (why := self.dead_zone(experts)):
                return why
        else:
            checks = [
                die_memory(
                    self.mb,
                    role="decode",
                    hbm=self.hbm,
                    weight_bytes=self.weight_bytes,
                    has_attention=True,
                    experts=slots + shared_here,
                    kv_tokens=kv_tokens,
                    kv_int8=c.kv_int8,
                )
            ]
        if c.prefill_dies:
            prefill_experts = experts_per_die(self.m.num_routed_experts, c.prefill_te_dies) + 1
            checks.append(
                die_memory(
                    self.mb,
                    role="prefill",
                    hbm=self.hbm,
                    weight_bytes=self.weight_bytes,
                    has_attention=True,
                    experts=prefill_experts,
                    kv_tokens=self.max_prompt / c.prefill_tp,
                    kv_int8=c.kv_int8,
                )
            )
        return next((d.why_not() for d in checks if not d.fits), "")


def _key(sets, key: str) -> int:
    return int(next(s for s in sets if s.startswith(key + "=")).split("=")[1])


def _label(kind, sets, dies, k, p, tp, mtp, kv8, batch) -> str:
    if kind == "afd":
        a = _key(sets, "deployment.dp_groups_per_domain")
        d = _key(sets, "deployment.num_dp_domains")
        e = _key(sets, "deployment.num_expert_dies")
        mb = _key(sets, "deployment.num_microbatches")
        shape = f"afd {d}x{a}A:{e}E mb{mb}"
    else:
        shape = f"EP{dies}"
    red = _key(sets, "deployment.redundant_slots_per_die")
    pre = f" + {k}x{p}P tp{tp}" if k else ""
    return f"{shape}{pre} b{batch} mtp{mtp}" + (" kv8" if kv8 else "") + (f" r{red}" if red else "")


def with_sets(c: Candidate, extra: tuple[str, ...]) -> Candidate:
    return replace(c, sets=(*c.sets, *extra))
