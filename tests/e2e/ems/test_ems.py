"""The EMS context cache (`ems.enabled`, docs/ems.md): block keys, consistent hashing, the pool's
LRU and a reader's check, the refusals, and PD runs of a crafted trace whose hit pattern is known
exactly, served with `--check` (one with room for every block, one with a tiny pool evicting)."""

from __future__ import annotations

import json
import logging
import subprocess
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT
from test_serving import XDS_MPI, check_line

from ranks.ems.client import EmsClient
from ranks.ems.messages import EmsPut
from ranks.ems.pool import PoolServer
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.ems.cache import Directory, Record, Ring, block_keys, lookup_blocks, verified
from xds_mpi.model.mla import LatentCache
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.workload.requests import Request

NS = b"namespac"
BT = 16  # configs/pd.yaml's scheduler.kv_block_tokens
# The crafted trace: (timestamp ms, input_length, hash ids); a 512-token id serves 16 tokens
# (trace.length_scale 1/32), one KV block. Two seconds apart: each request's puts land before
# the next one looks up.
CRAFTED = [
    (0, 1536, [1, 2, 3]),  # nothing cached: puts 3 blocks
    (2000, 2048, [1, 2, 3, 4]),  # 3 hits (block 4 holds the last token): puts block 4
    (4000, 1536, [1, 2, 5]),  # 2 hits (block 3 holds the last token): puts block 5
    (6000, 1500, [1, 2, 3]),  # 47 tokens: 2 full blocks, both hits; nothing to put
    (8000, 1536, [6, 2, 3]),  # block 0 differs: the chain differs, 0 hits; puts 3
    (10000, 2048, [1, 2, 3, 4]),  # 3 hits; its block 4 is already held
]


def served_len(n_in: int) -> int:
    return round(n_in / 32)


def test_block_keys_chain_over_the_prefix():
    a = block_keys(list(range(40)), BT, NS)  # 2 full blocks: the partial third has no key
    b = block_keys(list(range(32)) + [7] * 16, BT, NS)
    assert len(a) == 2 and len(b) == 3 and a == b[:2]
    c = block_keys([99] + list(range(1, 48)), BT, NS)  # one token of block 0 differs
    assert all(x != y for x, y in zip(b, c))  # every later key differs: chained
    assert block_keys(list(range(32)), BT, b"othermod") != a  # another namespace
    assert (lookup_blocks(48, BT), lookup_blocks(47, BT), lookup_blocks(49, BT)) == (2, 2, 3)


def test_ring_spreads_and_moves_only_the_new_members_keys():
    keys = block_keys(list(range(16 * 2000)), BT, NS)
    two, three = Ring([8, 9]), Ring([8, 9, 10])
    owners = [two.owner(k) for k in keys]
    assert 0.3 < owners.count(8) / len(keys) < 0.7
    moved = [(two.owner(k), three.owner(k)) for k in keys if two.owner(k) != three.owner(k)]
    assert moved and all(new == 10 for _, new in moved)  # consistent: only to the new member
    assert 0.15 < len(moved) / len(keys) < 0.5


def test_directory_evicts_the_least_recently_used():
    d = Directory(2)
    assert d.place(11).evicted == 0 and d.place(12).evicted == 0
    d.touch(11)  # read: 12 is now the least recently used
    placed = d.place(13)
    assert placed.evicted == 12 and 12 not in d and 11 in d and len(d) == 2
    with pytest.raises(ValueError, match="already in slot"):
        d.place(11)


def test_a_reader_checks_the_record_before_and_after():
    good = Record(key=5, version=4, nbytes=100)
    assert verified(5, 100, good, 4)
    assert not verified(6, 100, good, 4)  # another block's slot
    assert not verified(5, 99, good, 4)  # another size
    assert not verified(5, 100, good, 6)  # rewritten during the pull (evicted)
    assert not verified(5, 100, Record(key=5, version=5, nbytes=100), 5)  # being written


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["scheduler.mtp_depth=1"], r"scheduler.mtp_depth\(1\)"),
        (
            ["faults.events=[{kind: dead, die: 6, iteration: 3}]"],
            r"1 faults.events row\(s\)",
        ),
        (
            ["faults.table=[{die: 8, layer: 1, op: dispatch, iteration: 1}]"],
            r"faults.table\[0\].die\(8\) is an EMS pool rank",
        ),
        (["ems.capacity_blocks=0"], r"ems.capacity_blocks must be > 0"),
    ],
)
def test_refused_before_launch(sets, match):
    with pytest.raises(ConfigError, match=match):
        cfg = load_config(REPO_ROOT / "configs" / "pd.yaml", ["ems.enabled=true", *sets])
        DeploymentPlan.build(cfg)


def test_pool_ranks_follow_the_dies():
    cfg = load_config(REPO_ROOT / "configs" / "pd.yaml", ["ems.enabled=true", "ems.servers=2"])
    plan = DeploymentPlan.build(cfg)
    assert plan.topo.world_size == 10 and plan.ems.pool == (8, 9)
    assert [plan.topo.ranks[r].role for r in (8, 9)] == ["pool", "pool"]
    assert plan.window_bytes[8] == plan.ems.window_bytes == 8 + 256 * (32 + 20480)  # status word
    with pytest.raises(ConfigError, match=r"ems pool ranks\(2\) = 10"):
        DeploymentPlan.build(cfg, world_size=8)


def expected(capacity: int) -> dict:
    """The counts one pool rank of `capacity` blocks gives the crafted trace: a block's identity
    is its chain of ids (ids give equal tokens); hits are looked up, then touched, then the
    request's other full blocks put, least recently used evicted first."""
    lru: OrderedDict = OrderedDict()
    out = dict.fromkeys(("requests_hit", "blocks_hit", "blocks_put", "evictions", "held"), 0)
    for _, n_in, ids in CRAFTED:
        n = served_len(n_in)
        chain = [tuple(ids[: i + 1]) for i in range(n // BT)]
        hits = 0
        for key in chain[: lookup_blocks(n, BT)]:
            if key not in lru:
                break
            hits += 1
        for key in chain[:hits]:
            lru.move_to_end(key)
        out["requests_hit"] += hits > 0
        out["blocks_hit"] += hits
        for key in chain[hits:]:
            out["blocks_put"] += 1
            if key in lru:
                lru.move_to_end(key)
                out["held"] += 1
                continue
            if len(lru) == capacity:
                lru.popitem(last=False)
                out["evictions"] += 1
            lru[key] = True
    return out


def serve_crafted(tmp_path: Path, name: str, *sets: str, config: str = "pd") -> dict:
    """The crafted trace served on `config` (pd, or colocated: the colocated dies use the pool)
    with `--check`; the run's summary."""
    path = tmp_path / "crafted.jsonl"
    rows = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": 64, "hash_ids": ids})
        for t, n, ids in CRAFTED
    ]
    path.write_text("\n".join(rows) + "\n")
    # 2 decode dies: 2 hosts + 2 decode + 2 prefill dies + the pool ranks stay within 8 ranks
    # (colocated: 1 host + 2 dies + the pool ranks)
    sets = ("ems.enabled=true", "deployment.dp_groups_per_domain=2",
            "workload.source=trace", f"trace.path={path}",
            "trace.length_scale=0.03125", "trace.output_scale=0.0625",
            f"run.output_dir={tmp_path}", f"run.name={name}", *sets)  # fmt: skip
    result = subprocess.run(
        [str(XDS_MPI), "run", config, "--check", *[a for s in sets for a in ("--set", s)]],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert check_line(result) == "check: 6 requests, 24 tokens, 0 mismatches"
    with h5py.File(tmp_path / f"{name}.h5", "r") as f:
        return dict(f["summary"].attrs)


def test_crafted_trace_hits_exactly(tmp_path):
    """Two pool ranks with room for every block: 4 requests hit, 10 blocks pulled (3 + 2 + 2 +
    3), 9 put of which 1 was already held, no eviction, every token equal to the reference."""
    s = serve_crafted(tmp_path, "hits", "ems.servers=2")
    want = expected(capacity=1000)
    assert (want["requests_hit"], want["blocks_hit"], want["blocks_put"]) == (4, 10, 9)
    assert s["ems_lookups"] == 6
    assert s["ems_requests_hit"] == want["requests_hit"]
    assert s["ems_blocks_hit"] == want["blocks_hit"]
    assert s["ems_bytes_pulled"] == 10 * BT * 1280  # 1280 B per token over the 4 layers
    assert s["ems_tokens_skipped"] == 10 * BT
    assert s["ems_blocks_put"] == want["blocks_put"]
    assert (s["ems_blocks_stored"], s["ems_puts_already_held"]) == (8, want["held"])
    assert (s["ems_evictions"], s["ems_fallbacks"], s["ems_blocks_held"]) == (0, 0, 8)
    # priced with the pool's own hits: faster than none, at most what an unbounded cache
    # would give (its request 4 keeps 1499 of 1500 trace tokens, the pool 1024: 2 blocks)
    p50 = [s[f"{k}projected_ttft_ms_p50"] for k in ("", "ems_", "cache_")]
    assert p50[0] > p50[1] > p50[2]
    assert_pool_within_the_what_if(tmp_path, "hits")


def assert_pool_within_the_what_if(tmp_path: Path, name: str) -> None:
    """Per request (/slo): the prefix the pool served, priced at the trace's lengths, is at most
    the unbounded what-if's and its TTFT at least the what-if's. Here it holds: each prompt's
    lookup comes after every earlier prompt's put (2 s apart) and no two hash ids of the crafted
    trace serve equal tokens (docs/ems.md#the-pool-against-the-unbounded-what-if says when it
    does not)."""
    with h5py.File(tmp_path / f"{name}.h5", "r") as f:
        slo = {k: f["slo"][k][()] for k in f["slo"]}
    # requests 3 and 5: the what-if keeps all but the last token, the pool the full blocks before
    # the block that holds it (its row samples the first token)
    assert list(slo["cache_cached_tokens"]) == [0, 1536, 1024, 1499, 0, 2047]
    assert list(slo["ems_cached_tokens"]) == [0, 1536, 1024, 1024, 0, 1536]
    assert (slo["ems_ttft_v_s"] >= slo["cache_ttft_v_s"]).all()
    assert (slo["ems_ttft_v_s"] <= slo["ttft_v_s"]).all()


def test_tiny_pool_evicts_and_stays_exact(tmp_path):
    """One pool rank of 4 blocks: the LRU evicts, fewer hits, the same tokens. At this
    capacity the reads' touches matter: first-in-first-out would give 2 requests hit, 5 blocks
    and 10 evictions."""
    s = serve_crafted(tmp_path, "evict", "ems.capacity_blocks=4")
    want = expected(capacity=4)
    assert (want["requests_hit"], want["blocks_hit"], want["evictions"]) == (3, 7, 8)
    assert s["ems_requests_hit"] == want["requests_hit"]
    assert s["ems_blocks_hit"] == want["blocks_hit"]
    assert s["ems_blocks_put"] == want["blocks_put"]
    assert s["ems_evictions"] == want["evictions"]
    assert s["ems_blocks_held"] == 4 and s["ems_fallbacks"] == 0


def test_a_dead_pool_rank_falls_back_to_recompute(tmp_path):
    """The only pool rank dies once it has taken request 0's put (its 3 blocks): every later
    lookup falls back to recompute (the die that reads it first declares it lost; with no pool
    rank left the others fall back at once), nothing more is put, and every token equals the
    reference."""
    s = serve_crafted(tmp_path, "dead", "ems.faults=[{kind: dead, server: 6, after_puts: 1}]")
    assert s["ems_pool_ranks_lost"] == 1 and s["ems_lookups"] == 6
    assert (s["ems_requests_hit"], s["ems_blocks_hit"]) == (0, 0)
    assert s["ems_fallbacks"] == s["ems_lost_fallbacks"] == 5  # requests 1-5
    assert (s["ems_blocks_put"], s["ems_blocks_stored"], s["ems_puts_dropped"]) == (3, 3, 0)
    assert s["ems_blocks_held"] == 0  # its DRAM is gone


def test_a_dead_pool_rank_of_two_is_declared_lost_and_the_survivor_keeps_serving(tmp_path):
    """Pool rank 6 of two is dead from the start: the die that reads it first (a lookup, or the
    leader's probe) declares it lost; a lookup that ends at a key placed on it falls back, and
    from then on every key is placed on rank 7, which still serves hits (the prefix recomputed
    after the fallback is put there); every token equals the reference."""
    s = serve_crafted(tmp_path, "dead2", "ems.servers=2", "ems.faults=[{kind: dead, server: 6}]")
    assert s["ems_pool_ranks_lost"] == 1 and s["ems_lost_fallbacks"] >= 1
    assert s["ems_fallbacks"] == s["ems_lost_fallbacks"]
    assert s["ems_requests_hit"] >= 1 and s["ems_blocks_held"] == s["ems_blocks_stored"]


def test_a_block_evicted_mid_lookup_falls_back_to_recompute(tmp_path):
    """Each prefill die's first lookup that finds a block has that block evicted between the
    record read and the pull (the slot's bytes overwritten): the pull does not verify, the
    prefix is recomputed from there (one fallback per eviction), and the tokens are exact."""
    s = serve_crafted(
        tmp_path,
        "evict",
        "ems.servers=2",
        "ems.faults=[{kind: evict, die: 4}, {kind: evict, die: 5}]",
    )
    assert s["ems_evicts_injected"] >= 1
    assert s["ems_fallbacks"] == s["ems_evicts_injected"] and s["ems_lost_fallbacks"] == 0
    assert s["ems_blocks_hit"] < 10  # the fault-free run's (test_crafted_trace_hits_exactly)
    assert s["ems_pool_ranks_lost"] == 0


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ("{kind: dead, server: 5}", r"ems.faults\[0\].server\(5\) is not an EMS pool rank"),
        ("{kind: evict, die: 6}", r"ems.faults\[0\].die\(6\) is not a prefill die"),
        ("{kind: dead, die: 4}", r"a dead row takes server and after_puts, not \['die'\]"),
        ("{kind: evict, die: 4, after_puts: 2}", r"takes die and lookup, not \['after_puts'\]"),
        ("{kind: dead}", r"a dead row needs server \(a rank\), got -1"),
        ("{kind: lost, server: 6}", r"unknown kind 'lost'"),
        ("{kind: dead, server: 6, after_puts: -1}", r"after_puts must be >= 0, got -1"),
    ],
)
def test_pool_fault_rows_refused_before_launch(row, match):
    with pytest.raises(ConfigError, match=match):
        cfg = load_config(
            REPO_ROOT / "configs" / "pd.yaml",
            ["ems.enabled=true", "deployment.dp_groups_per_domain=2", f"ems.faults=[{row}]"],
        )
        DeploymentPlan.build(cfg)


def test_a_repeated_pool_fault_row_is_refused():
    rows = "[{kind: dead, server: 6}, {kind: dead, server: 6, after_puts: 3}]"
    with pytest.raises(ConfigError, match=r"ems.faults\[1\] repeats ems.faults\[0\]"):
        cfg = load_config(
            REPO_ROOT / "configs" / "pd.yaml",
            ["ems.enabled=true", "deployment.dp_groups_per_domain=2", f"ems.faults={rows}"],
        )
        DeploymentPlan.build(cfg)


class FakeComm:
    """Sends are kept: (destination, message)."""

    rank = 6

    def __init__(self) -> None:
        self.sent = []

    def isend(self, msg, dest, tag):
        self.sent.append((dest, msg))


class SharedWindows:
    """Every pool rank's window as one local array, read by `get` and written by the pool rank:
    DieMemory's load/store path without MPI. `on_payload_get(owner, offset)` runs before a
    payload is copied out (to rewrite a slot in the middle of a pull)."""

    def __init__(self, plan) -> None:
        self.windows = {r: np.zeros(plan.window_bytes[r], np.uint8) for r in plan.ems.pool}
        self.payloads_at = plan.ems.payloads_at
        self.on_payload_get = None

    def of(self, rank):
        window = self.windows[rank]
        return SimpleNamespace(local=window, words=window.view(np.uint64), sync=lambda: None)

    def get(self, owner, offset, out):
        if self.on_payload_get and offset >= self.payloads_at:
            self.on_payload_get(owner, offset)
        raw = out.reshape(-1).view(np.uint8)
        raw[:] = self.windows[owner][offset : offset + raw.nbytes]

    def flush(self, owner):
        pass

    def fetch_word(self, owner, offset):
        return int(self.windows[owner][offset : offset + 8].view(np.uint64)[0])


def pool_and_client(capacity: int = 8, config: str = "pd"):
    cfg = load_config(
        REPO_ROOT / "configs" / f"{config}.yaml",
        ["ems.enabled=true", "ems.servers=2", f"ems.capacity_blocks={capacity}"],
    )
    plan = DeploymentPlan.build(cfg)
    shared = SharedWindows(plan)
    pools = {
        r: PoolServer(
            SimpleNamespace(plan=plan, cfg=cfg, comm=SimpleNamespace(rank=r)), shared.of(r)
        )
        for r in plan.ems.pool
    }
    ctx = SimpleNamespace(plan=plan, cfg=cfg, comm=FakeComm(), log=logging.getLogger("test_ems"))
    source = LatentCache(num_layers=cfg.model.num_layers, num_slots=64,
                         kv_lora_rank=cfg.model.kv_lora_rank, rope_dim=cfg.model.qk_rope_dim,
                         dtype=np.float64)  # fmt: skip
    source.keys[:] = np.random.default_rng(0).standard_normal(source.keys.shape)
    target = LatentCache(num_layers=cfg.model.num_layers, num_slots=64,
                         kv_lora_rank=cfg.model.kv_lora_rank, rope_dim=cfg.model.qk_rope_dim,
                         dtype=np.float64)  # fmt: skip
    return pools, EmsClient(ctx, shared, source), EmsClient(ctx, shared, target), shared


def test_put_then_pull_is_bit_exact_and_a_moved_record_falls_back():
    """A prompt's blocks put from one cache, the same prefix pulled into another at other slots:
    equal bytes. A slot rewritten during its pull ends the prefix there (a fallback)."""
    pools, writer, reader, shared = pool_and_client()
    prompt = tuple(range(100, 150))  # 50 tokens: 3 full blocks, all 3 before the last token
    writer.lookup(Request(req_id=0, prompt=prompt, max_new_tokens=1))  # empty pool: no hit
    writer.put(Request(req_id=0, prompt=prompt, max_new_tokens=1), list(range(50)))
    puts = [(dest, msg) for dest, msg in writer.comm.sent if isinstance(msg, EmsPut)]
    assert sum(len(msg.keys) for _, msg in puts) == 3
    for dest, msg in puts:
        pools[dest]._put(msg)
    hit = reader.lookup(Request(req_id=1, prompt=prompt, max_new_tokens=1))
    assert hit is not None and hit.num_blocks == 3
    slots = list(range(10, 58))
    reader.write(hit, slots)
    assert np.array_equal(reader.cache.keys[:, slots], writer.cache.keys[:, :48])
    assert reader.stats["blocks_hit"] == 3 and reader.stats["fallbacks"] == 0

    def rewrite_second_block(owner, offset):  # the pool rewrites slot of block 1 meanwhile
        key = reader.keys[2][1]
        if owner == reader.ring.owner(key):
            slot = (offset - shared.payloads_at) // reader.ems.slot_stride
            record = shared.windows[owner][reader.ems.record_offset(slot) :].view(np.uint64)
            if record[0] == key:
                record[1] += 2

    shared.on_payload_get = rewrite_second_block
    hit = reader.lookup(Request(req_id=2, prompt=prompt, max_new_tokens=1))
    assert hit.num_blocks == 1 and reader.stats["fallbacks"] == 1


def test_a_slurm_job_places_the_pool_ranks_on_the_last_node():
    from launch.slurm.jobscript import node_layout

    cfg = load_config(REPO_ROOT / "configs" / "pd.yaml", ["ems.enabled=true", "ems.servers=2"])
    layout = node_layout(DeploymentPlan.build(cfg).topo)
    assert sum(layout.tasks_per_node) == 10 and "2 EMS pool rank(s) on the last" in layout.why


def test_the_prefill_cost_counts_the_hit():
    """§4.3: a busy group takes one more request within one step's rows only if the pool holds
    enough of its prompt."""
    from xds_mpi.pd.prefill import PrefillStatus, assign

    busy = PrefillStatus(free_blocks=100, room=8, queued_tokens=40, length_class=0)
    req = Request(req_id=3, prompt=tuple(range(40)), max_new_tokens=4)
    kwargs = dict(block_tokens=BT, long_prompt_tokens=48, step_tokens=64)
    assert assign([req], [busy], **kwargs) == ([[]], [req])  # 40 + 40 > 64 rows
    assert assign([req], [busy], **kwargs, cached={3: 32}) == ([[req]], [])  # 40 + 8


def test_a_pool_rank_dying_during_a_pull_is_declared_lost_and_its_bytes_never_used():
    """The first block's pool rank dies between the record read and the payload's copy (status
    LOST, then its DRAM overwritten): the pull is thrown away, the pool rank declared lost once,
    and the ring places every key on the survivor from then on."""
    pools, writer, reader, shared = pool_and_client()
    prompt = tuple(range(100, 150))
    writer.lookup(Request(req_id=0, prompt=prompt, max_new_tokens=1))
    writer.put(Request(req_id=0, prompt=prompt, max_new_tokens=1), list(range(50)))
    for dest, msg in writer.comm.sent:
        pools[dest]._put(msg)
    keys = block_keys(prompt, BT, reader.ems.namespace)
    dying = reader.ring.owner(keys[0])

    def die_now(owner, offset):
        if owner == dying:
            pools[owner].dies_after = 0
            pools[owner]._die_if_due()

    shared.on_payload_get = die_now
    assert reader.lookup(Request(req_id=1, prompt=prompt, max_new_tokens=1)) is None
    assert reader.lost == {dying} and pools[dying].is_lost
    assert reader.stats["fallbacks"] == reader.stats["lost_fallbacks"] == 1
    (survivor,) = set(pools) - {dying}
    assert {reader.ring.owner(k) for k in keys} == {survivor}
    # Its first key was placed on the lost rank and is on no survivor yet: a fallback again;
    # the recomputed prompt's put goes to the survivor, and then the prefix hits there.
    assert reader.lookup(Request(req_id=2, prompt=prompt, max_new_tokens=1)) is None
    assert reader.stats["fallbacks"] == reader.stats["lost_fallbacks"] == 2
    reader.comm.sent.clear()
    reader.put(Request(req_id=2, prompt=prompt, max_new_tokens=1), list(range(10, 60)))
    assert {dest for dest, _ in reader.comm.sent} == {survivor}
    for dest, msg in reader.comm.sent:
        pools[dest]._put(msg)
    hit = reader.lookup(Request(req_id=3, prompt=prompt, max_new_tokens=1))
    assert hit is not None and hit.num_blocks == 3 and reader.stats["fallbacks"] == 2


def test_validate_names_the_pool_faults():
    from xds_mpi.plan.ems import describe_ems

    cfg = load_config(
        REPO_ROOT / "configs" / "pd.yaml",
        ["ems.enabled=true", "ems.servers=2", "deployment.dp_groups_per_domain=2",
         "ems.faults=[{kind: dead, server: 7, after_puts: 3}, {kind: evict, die: 5, lookup: 2}]"],
    )  # fmt: skip
    line = describe_ems(DeploymentPlan.build(cfg).ems)
    assert line.endswith(
        "; pool rank 7 dies after 3 put message(s)"
        "; die rank 5: a block evicted at its finding lookup 2"
    )


def test_two_hash_ids_serving_equal_tokens_let_the_pool_beat_the_what_if(tmp_path):
    """Why the unbounded what-if is no per-request bound of the pool at 2 served tokens per hash
    id (docs/ems.md#the-pool-against-the-unbounded-what-if): with seed 0 hash ids 227 and 473
    serve the same 2 tokens (the tiny vocabulary has 260 x 260 blocks), so a prompt [0, 473, ..]
    after [0, 227, ..] really shares 2 served blocks, which the pool keys on and pulls, while
    the what-if, keyed on the trace's ids, counts 1: priced at the trace's lengths, the pool's
    TTFT is the lower one."""
    from xds_mpi.config.hardware import load_profile
    from xds_mpi.results.request_pricing import RequestPricer, planes
    from xds_mpi.workload.trace_replay import cached_tokens, hit_blocks, trace_requests

    path = tmp_path / "pair.jsonl"
    rows = [(0, [0, 227, 5]), (2000, [0, 473, 6])]
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": 1536, "output_length": 64, "hash_ids": ids})
            + "\n"
            for t, ids in rows
        )
    )
    cfg = load_config(
        REPO_ROOT / "configs" / "pd.yaml",
        ["workload.source=trace", f"trace.path={path}", "trace.length_scale=0.00390625",
         "scheduler.kv_block_tokens=2", "workload.seed=0"],
    )  # fmt: skip
    a, b = trace_requests(cfg)
    assert len(b.prompt) == 6 and b.prompt[2:4] == a.prompt[2:4]  # ids 227, 473: equal tokens
    assert hit_blocks([a, b]) == {0: 0, 1: 1}  # the what-if: id 0 only
    keys_a, keys_b = block_keys(a.prompt, 2, NS), block_keys(b.prompt, 2, NS)
    pool_blocks = lookup_blocks(len(b.prompt), 2)  # the full blocks before the last token
    assert pool_blocks == 2 and keys_b[:2] == keys_a[:2] and keys_b[2] != keys_a[2]
    pricer = RequestPricer(cfg, num_prefill_dies=2, num_decode_dies=4, batch_per_die=1, is_pd=True)
    ub = planes(load_profile(cfg.hardware.profile))["UB"]
    what_if, pool = (cached_tokens(b, n, cfg.trace.block_tokens) for n in (1, pool_blocks))
    assert (what_if, pool) == (512, 1024)
    assert pricer.price(b, pool, ub).ttft_s < pricer.price(b, what_if, ub).ttft_s


def test_a_prompt_looked_up_after_a_later_arrivals_put_pulls_what_the_what_if_never_counts():
    """The other reason the what-if is no per-request bound (docs/ems.md#the-pool-against-the-
    unbounded-what-if): it counts, for each request, the blocks of the requests that arrived
    before it; the pool is read when the request is assigned to a die. Prompt A waits in the
    prefill leader's queue while B, a later turn of A's conversation (A's prompt and more),
    arrives, is assigned, prefilled and put: A's lookup then pulls B's blocks, 3 of them, where
    the what-if gives A none."""
    from xds_mpi.workload.trace_replay import hit_blocks

    pools, writer, reader, _ = pool_and_client()
    a = Request(req_id=0, prompt=tuple(range(100, 150)), max_new_tokens=1, arrival_s=0.0,
                block_ids=(1, 2, 3, 4))  # fmt: skip
    b = Request(req_id=1, prompt=a.prompt + tuple(range(10)), max_new_tokens=1, arrival_s=1.0,
                block_ids=(1, 2, 3, 4, 5))  # fmt: skip
    assert hit_blocks([a, b]) == {0: 0, 1: 4}  # the what-if: in arrival order
    assert writer.lookup(b) is None  # B first: nothing cached yet
    writer.put(b, list(range(len(b.prompt))))
    for dest, msg in writer.comm.sent:
        if isinstance(msg, EmsPut):
            pools[dest]._put(msg)
    hit = reader.lookup(a)  # A assigned after B's put landed
    assert hit is not None and hit.num_blocks == 3  # its 3 full blocks before the last token


class WaitingQueue:
    """What a colocated die's EMS side reads of its scheduler: the waiting queue, the running
    requests, the held prefixes; `cancel` drops a waiting request as DieScheduler.cancel does."""

    def __init__(self) -> None:
        self.waiting, self.running, self.prefix_hits = [], {}, None

    def cancel(self, req_id: int) -> None:
        self.waiting = [req for req in self.waiting if req.req_id != req_id]


def test_a_colocated_die_forgets_the_ems_lookups_of_cancelled_requests(monkeypatch):
    """A served request cancelled while it waits (its client went away): the pulled prefix held
    for its admission, its keys and its looked-up mark go at the die's next lookup round, so a
    server holds nothing for the requests it dropped; one admitted and put is forgotten too."""
    from ranks.colocated.die import ColocatedDie

    pools, writer, _, shared = pool_and_client(config="colocated")
    prompt = tuple(range(100, 150))  # 3 full blocks, put by another die
    writer.put(Request(req_id=0, prompt=prompt, max_new_tokens=1), list(range(50)))
    for dest, msg in writer.comm.sent:
        if isinstance(msg, EmsPut):
            pools[dest]._put(msg)
    cfg = load_config(
        REPO_ROOT / "configs" / "colocated.yaml",
        ["ems.enabled=true", "ems.servers=2", "ems.capacity_blocks=8"],
    )
    plan = DeploymentPlan.build(cfg)
    comm = FakeComm()
    comm.rank = plan.ems.clients[0]
    ctx = SimpleNamespace(plan=plan, cfg=cfg, comm=comm, log=logging.getLogger("test_ems"))
    die = ColocatedDie.__new__(ColocatedDie)  # its EMS side only, no MPI job
    die.scheduler, die.mem = WaitingQueue(), shared
    die.pricer = SimpleNamespace(pool_pull=lambda seconds: None)
    die.ems = die._ems_client(ctx, writer.cache)
    cancelled, served = (Request(req_id=i, prompt=prompt, max_new_tokens=4) for i in (7, 8))
    die.scheduler.waiting = [cancelled, served]
    die._pull_prefixes()
    assert set(die.scheduler.prefix_hits) == {7, 8}  # both hit the 3 blocks
    die.scheduler.cancel(7)
    die.scheduler.waiting = []  # request 8 admitted: its pulled blocks written
    die.scheduler.running = {8: SimpleNamespace(req=served, num_generated=0)}
    die.scheduler.prefix_hits.pop(8)
    die.scheduler.table = SimpleNamespace(slots=lambda req_id: list(range(50)))
    die._pull_prefixes()  # the next iteration's round
    die._put_prompts({8: None})
    held = (die.scheduler.prefix_hits, die.ems.keys, die.ems.hit_blocks)
    assert held == ({}, {}, {}), held
    assert not getattr(die.ems, "looked_up", set()) and not getattr(die, "looked_up", set())
