"""A prefill die's side of the EMS context cache (docs/ems.md; CloudMatrix-Infer §4.4.2).

Lookup, when a request is assigned to this die: the keys of the prompt's full blocks before its
last token (xds_mpi/engine/ems.py), each key's pool rank by consistent hashing; the die Gets the
owners' metadata records, then for each key in order pulls the payload of the slot whose record
names it and reads that record's version again (`verified`). The first key not found, or a
payload whose record moved (evicted or rewritten meanwhile: a fallback), ends the prefix: those
blocks are computed. The pulled blocks are written into the request's own KV slots when the
scheduler admits it, and prefill starts after them (chunked prefill's path: a chunk on top of
earlier KV). The pool rank learns what was read (a touch message, for its LRU order).

Put, when a prompt is done: the full blocks it computed (never decode-generated ones) go to their
pool ranks as messages, sent without waiting (ranks/pd/ems_pool.py says why two-sided).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ranks.core.ems_messages import EmsDone, EmsPut, EmsTouch
from xds_mpi.engine.ems import Record, Ring, block_keys, lookup_blocks, verified
from xds_mpi.engine.pd_kv import projected_kv_bytes
from xds_mpi.engine.request_pricing import planes
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.ems import RECORD_WORDS, WORD_BYTES
from xds_mpi.projection.hardware import load_profile
from xds_mpi.tags import TAG_EMS


@dataclass(frozen=True, kw_only=True)
class Hit:
    """A request's cached prefix: its blocks' packed KV, in order."""

    num_blocks: int
    payloads: tuple[np.ndarray, ...]


class EmsClient:
    def __init__(self, ctx, mem, cache) -> None:
        self.comm, self.mem, self.ems = ctx.comm, mem, ctx.plan.ems
        if cache.token_nbytes * self.ems.block_tokens != self.ems.block_bytes:
            raise ValueError(
                f"EMS block of {self.ems.block_bytes} B in the plan, but this die's cache packs "
                f"{cache.token_nbytes * self.ems.block_tokens} B per block"
            )
        self.cache = cache
        self.ub = _ub_plane(ctx.cfg)
        self.big = cost_shape()
        self.kv_int8 = ctx.cfg.scheduler.kv_int8
        self.ring = Ring(self.ems.pool)
        self.bases = {r: ctx.plan.p2p.window_bytes(r) for r in self.ems.pool}
        self.keys: dict[int, list[int]] = {}  # req_id -> its prompt's full blocks' keys
        self.hit_blocks: dict[int, int] = {}  # req_id -> blocks pulled (until its put)
        self.hit_tokens: dict[int, int] = {}  # req_id -> prompt tokens pulled (the report)
        self.sends: list[MPI.Request] = []
        self.stats = {
            "lookups": 0,
            "requests_hit": 0,
            "blocks_hit": 0,
            "bytes_pulled": 0,
            "tokens_skipped": 0,
            "fallbacks": 0,
            "blocks_put": 0,
            "bytes_put": 0,
            "lookup_wall_s": 0.0,
        }

    def lookup(self, req) -> Hit | None:
        """The longest cached prefix of `req`'s prompt that verifies, pulled; None: no hit."""
        began = time.perf_counter()
        keys = block_keys(req.prompt, self.ems.block_tokens, self.ems.namespace)
        self.keys[req.req_id] = keys
        self.stats["lookups"] += 1
        wanted = keys[: lookup_blocks(len(req.prompt), self.ems.block_tokens)]
        records: dict[int, dict[int, tuple[int, Record]]] = {}
        payloads = []
        for key in wanted:
            owner = self.ring.owner(key)
            if owner not in records:
                records[owner] = self._records(owner)
            found = records[owner].get(key)
            if found is None:
                break
            payload = self._pull(owner, key, *found)
            if payload is None:
                self.stats["fallbacks"] += 1
                break
            payloads.append(payload)
        self.stats["lookup_wall_s"] += time.perf_counter() - began
        if not payloads:
            return None
        num = len(payloads)
        self.hit_blocks[req.req_id] = num
        self.hit_tokens[req.req_id] = num * self.ems.block_tokens
        self.stats["requests_hit"] += 1
        self.stats["blocks_hit"] += num
        self.stats["bytes_pulled"] += num * self.ems.block_bytes
        self.stats["tokens_skipped"] += num * self.ems.block_tokens
        self._touch(keys[:num])
        return Hit(num_blocks=num, payloads=tuple(payloads))

    def probe(self, req) -> int:
        """Prompt tokens of the cached prefix the records name, nothing pulled or counted: the
        prefill leader's cost estimate (§4.3), which a pull may later fall short of."""
        keys = block_keys(req.prompt, self.ems.block_tokens, self.ems.namespace)
        records: dict[int, dict] = {}
        num = 0
        for key in keys[: lookup_blocks(len(req.prompt), self.ems.block_tokens)]:
            owner = self.ring.owner(key)
            if owner not in records:
                records[owner] = self._records(owner)
            if key not in records[owner]:
                break
            num += 1
        return num * self.ems.block_tokens

    def _records(self, owner: int) -> dict[int, tuple[int, Record]]:
        """key -> (slot, record) of every stable record of `owner`'s window (one Get)."""
        words = np.empty(self.ems.capacity * RECORD_WORDS, np.uint64)
        self.mem.get(owner, self.bases[owner], words)
        self.mem.flush(owner)
        table = {}
        for slot in range(self.ems.capacity):
            record = Record.of(words[slot * RECORD_WORDS : (slot + 1) * RECORD_WORDS])
            if record.key and record.version % 2 == 0:
                table[record.key] = (slot, record)
        return table

    def _pull(self, owner: int, key: int, slot: int, before: Record) -> np.ndarray | None:
        """The slot's payload if it is still `key`'s after the pull, else None."""
        out = np.empty(self.ems.block_bytes, np.uint8)
        self.mem.get(owner, self.bases[owner] + self.ems.payload_offset(slot), out)
        self.mem.flush(owner)
        version_at = self.bases[owner] + self.ems.record_offset(slot) + WORD_BYTES
        after = self.mem.fetch_word(owner, version_at)
        return out if verified(key, self.ems.block_bytes, before, after) else None

    def _touch(self, keys: list[int]) -> None:
        by_owner: dict[int, list[int]] = {}
        for key in keys:
            by_owner.setdefault(self.ring.owner(key), []).append(key)
        for owner, owned in by_owner.items():
            msg = EmsTouch(keys=tuple(owned))
            self.sends.append(self.comm.isend(msg, dest=owner, tag=TAG_EMS))

    def pull_s(self, hit: Hit) -> float:
        """The projected seconds of the pull: the prefix's latent KV at the cost shape (every
        layer + MTP, BF16 or INT8 latent) read over UB from a pool server."""
        num_tokens = hit.num_blocks * self.ems.block_tokens
        return self.ub.pull_s(projected_kv_bytes(num_tokens, self.big, kv_int8=self.kv_int8))

    def write(self, hit: Hit, slots: list[int]) -> None:
        """The pulled blocks into the request's first KV slots (the scheduler's admission)."""
        bt = self.ems.block_tokens
        for i, payload in enumerate(hit.payloads):
            self.cache.unpack(np.array(slots[i * bt : (i + 1) * bt], dtype=np.int64), payload)

    def put(self, req, slots: list[int]) -> None:
        """A finished prompt's computed full blocks to their pool ranks (not waited for)."""
        keys = self.keys.pop(req.req_id, None)
        if keys is None:
            keys = block_keys(req.prompt, self.ems.block_tokens, self.ems.namespace)
        first = self.hit_blocks.pop(req.req_id, 0)
        bt = self.ems.block_tokens
        by_owner: dict[int, list[tuple[int, np.ndarray]]] = {}
        for i in range(first, len(keys)):
            block = np.array(slots[i * bt : (i + 1) * bt], dtype=np.int64)
            packed = np.concatenate(self.cache.pack(block))
            by_owner.setdefault(self.ring.owner(keys[i]), []).append((keys[i], packed))
        for owner, blocks in by_owner.items():
            msg = EmsPut(
                keys=tuple(k for k, _ in blocks), payload=np.concatenate([p for _, p in blocks])
            )
            self.sends.append(self.comm.isend(msg, dest=owner, tag=TAG_EMS))
            self.stats["blocks_put"] += len(blocks)
            self.stats["bytes_put"] += msg.payload.nbytes

    def close(self) -> dict:
        """Tell every pool rank this die is done (on the puts' tag: it arrives after them);
        the stats."""
        for owner in self.ems.pool:
            done = EmsDone(rank=self.comm.rank)
            self.sends.append(self.comm.isend(done, dest=owner, tag=TAG_EMS))
        MPI.Request.Waitall(self.sends)
        return {**self.stats, "hit_tokens": dict(self.hit_tokens)}


def _ub_plane(cfg):
    """The UB plane of the prefill dies' hardware profile (a pool server's DRAM over UB)."""
    return planes(load_profile(cfg.pd.prefill_profile or cfg.hardware.profile))["UB"]
