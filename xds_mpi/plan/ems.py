"""The EMS context cache's plan (docs/ems.md): the pool ranks, each one's window layout, and what
the rest of the config must hold for it, refused before launch with the reason.

A pool rank's window stands for the CPU DRAM its server gives the pool (CloudMatrix-Infer
§4.4.1): `capacity` slots of one KV block each. It opens with a status word (`LOST` once the
pool rank is dead: it stands for the error a UB read of a dead server's DRAM completes with,
which an MPI Get from a live process cannot give), then the metadata records, one per slot
(`RECORD_WORDS` words: the block key, a version, the payload bytes, spare), then the payloads. The
pool rank alone writes it (puts reach it as messages: it owns the slots and the LRU order); the
dies that prefill (the prefill dies with PD, else the colocated dies) read records and payloads
one-sidedly and check a payload against its record.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.plan.kv_memory import token_layer_bytes
from xds_mpi.plan.topology import Topology

RECORD_WORDS = 4  # key, version (odd while the pool writes the slot), payload bytes, spare
WORD_BYTES = 8
STATUS_OFFSET = 0  # the status word: SERVING, or LOST once the pool rank is dead
SERVING, LOST = 0, 1
MODEL_ITEMSIZE = 8  # the tiny model's cache is float64 (xds_mpi/model/mla.py LatentCache)


@dataclass(frozen=True, kw_only=True)
class EmsPlan:
    """pool: the pool ranks; clients: the dies that read and put (the prefill dies with PD, the
    colocated dies without); capacity: slots per pool rank;
    block_tokens: tokens per block; block_bytes: one block's packed KV (every cache layer);
    namespace: the seed of every key (the model and the cache's format: another config's blocks
    never match). faults: the `ems.faults` rows (xds_mpi/config/ems.py PoolFault)."""

    pool: tuple[int, ...]
    clients: tuple[int, ...]
    capacity: int
    block_tokens: int
    block_bytes: int
    namespace: bytes
    faults: tuple = ()

    @property
    def records_bytes(self) -> int:
        return self.capacity * RECORD_WORDS * WORD_BYTES

    @property
    def payloads_at(self) -> int:
        """Where the payloads begin: after the status word and the records."""
        return WORD_BYTES + self.records_bytes

    @property
    def slot_stride(self) -> int:
        return -(-self.block_bytes // WORD_BYTES) * WORD_BYTES

    @property
    def window_bytes(self) -> int:
        return self.payloads_at + self.capacity * self.slot_stride

    def record_offset(self, slot: int) -> int:
        return WORD_BYTES + slot * RECORD_WORDS * WORD_BYTES

    def payload_offset(self, slot: int) -> int:
        return self.payloads_at + slot * self.slot_stride

    def dead_after(self, server: int) -> int | None:
        """The put messages pool rank `server` takes before it dies; None: it does not."""
        rows = [f.after_puts for f in self.faults if f.kind == "dead" and f.server == server]
        return rows[0] if rows else None

    def evict_lookups(self, die: int) -> frozenset[int]:
        """Which of client die `die`'s lookups that find a block have it evicted mid-lookup."""
        return frozenset(f.lookup for f in self.faults if f.kind == "evict" and f.die == die)


def build_ems(cfg: Config, topo: Topology) -> EmsPlan | None:
    """The EMS plan, None when `ems.enabled` is off; refuses what this version cannot serve."""
    ems = cfg.ems
    if not ems.enabled:
        return None
    check_ems(cfg, topo)
    import hashlib  # the namespace's digest: every rank builds the plan, few run the EMS

    import yaml  # start-up: PyYAML only where EMS runs (docs/scale.md)

    model, sched = cfg.model, cfg.scheduler
    token_bytes = model.num_layers * token_layer_bytes(
        model, itemsize=MODEL_ITEMSIZE, kv_int8=sched.kv_int8
    )
    identity = {"model": cfg.model.__dict__, "kv_int8": sched.kv_int8}
    text = yaml.safe_dump(identity, sort_keys=True, default_flow_style=True)
    return EmsPlan(
        pool=topo.ranks_with_role("pool"),
        clients=client_dies(cfg, topo),
        capacity=ems.capacity_blocks,
        block_tokens=sched.kv_block_tokens,
        block_bytes=sched.kv_block_tokens * token_bytes,
        namespace=hashlib.blake2b(text.encode(), digest_size=8).digest(),
        faults=tuple(ems.faults),
    )


def client_dies(cfg: Config, topo: Topology) -> tuple[int, ...]:
    """The dies that prefill prompts and so use the pool: the prefill dies with PD, the
    colocated dies without (they prefill new requests in chunks between decode rows)."""
    return topo.ranks_with_role("prefill" if cfg.pd.enabled else "colocated")


def check_ems(cfg: Config, topo: Topology) -> None:
    """What this version of the pool cannot serve (before the fault checks: a fault row naming a
    pool rank is refused here with that reason)."""
    if not cfg.ems.enabled:
        return
    if not cfg.pd.enabled and cfg.deployment.kind != "colocated":
        raise ConfigError(
            "ems.enabled needs pd.enabled or deployment.kind colocated: the pool serves the "
            "prefill dies' or the colocated dies' prefix hits (deployment.kind"
            f"({cfg.deployment.kind}) without PD prefills on its attention dies, which this "
            "version does not connect to the pool)"
        )
    if cfg.scheduler.mtp_depth:
        raise ConfigError(
            f"ems.enabled with scheduler.mtp_depth({cfg.scheduler.mtp_depth}): a cached prefix "
            "would need the MTP modules' state at its last token, which the pool does not keep "
            "in this version; set scheduler.mtp_depth=0"
        )
    if cfg.faults.events:
        raise ConfigError(
            f"ems.enabled with {len(cfg.faults.events)} faults.events row(s): a pool rank waits "
            "for every die's end of run, which a lost die never sends (a failover would have to "
            "tell the pool ranks), and nothing watches a pool rank's own liveness (ems.faults "
            "evicts blocks instead)"
        )
    pool = set(topo.ranks_with_role("pool"))
    for i, spec in enumerate(cfg.faults.table):
        if spec.die in pool:
            raise ConfigError(
                f"faults.table[{i}].die({spec.die}) is an EMS pool rank (no die): "
                "a pool rank's faults are ems.faults rows (docs/ems.md#pool-faults)"
            )
    _check_pool_faults(cfg, topo)


def _check_pool_faults(cfg: Config, topo: Topology) -> None:
    """`ems.faults` rows against the ranks: a dead row names a pool rank, an evict row a die
    that uses the pool, and no two rows the same event."""
    pool, clients = topo.ranks_with_role("pool"), client_dies(cfg, topo)
    kind = "prefill" if cfg.pd.enabled else "colocated"
    seen: dict[tuple, int] = {}
    for i, spec in enumerate(cfg.ems.faults):
        where = f"ems.faults[{i}]"
        if spec.kind == "dead" and spec.server not in pool:
            raise ConfigError(
                f"{where}.server({spec.server}) is not an EMS pool rank: {list(pool)}"
            )
        if spec.kind == "evict" and spec.die not in clients:
            raise ConfigError(
                f"{where}.die({spec.die}) is not a {kind} die (the dies that use the pool): "
                f"{list(clients)}"
            )
        event = (
            (spec.kind, spec.server) if spec.kind == "dead" else (spec.kind, spec.die, spec.lookup)
        )
        if event in seen:
            raise ConfigError(f"{where} repeats ems.faults[{seen[event]}] ({spec.kind})")
        seen[event] = i


def ems_window_bytes(plan: EmsPlan | None, windows: tuple[int, ...]) -> tuple[int, ...]:
    """Each rank's window with the pool ranks' slots (their CPU DRAM). Not held to
    xccl.max_window_bytes, a die's HBM cap: the pool is host memory."""
    if plan is None:
        return windows
    sizes = list(windows)
    for rank in plan.pool:
        sizes[rank] += plan.window_bytes
    return tuple(sizes)


def describe_ems(plan: EmsPlan) -> str:
    """`xds-mpi validate`'s EMS line."""
    return (
        f"EMS pool: ranks {list(plan.pool)} (no die; CPU DRAM over UB), {plan.capacity} "
        f"blocks of {plan.block_tokens} tokens ({plan.block_bytes} B) each, "
        f"{plan.window_bytes} B window per pool rank"
        + "".join(f"; {describe_fault(f)}" for f in plan.faults)
    )


def describe_fault(spec) -> str:
    """An ems.faults row as `xds-mpi validate` prints it."""
    if spec.kind == "dead":
        return f"pool rank {spec.server} dies after {spec.after_puts} put message(s)"
    return f"die rank {spec.die}: a block evicted at its finding lookup {spec.lookup}"
