"""A die's side of the EMS context cache (docs/ems.md; CloudMatrix-Infer §4.4.2): the prefill
dies with PD, the colocated dies without.

Lookup, when a request is assigned to this die: the keys of the prompt's full blocks before its
last token (xds_mpi/ems/cache.py), each key's pool rank by consistent hashing; the die Gets the
owners' metadata records, then for each key in order pulls the payload of the slot whose record
names it and reads that record's version again (`verified`). The first key not found, or a
payload whose record moved (evicted or rewritten meanwhile: a fallback), ends the prefix: those
blocks are computed. The pulled blocks are written into the request's own KV slots when the
scheduler admits it, and prefill starts after them (chunked prefill's path: a chunk on top of
earlier KV). The pool rank learns what was read (a touch message, for its LRU order).

Put, when a prompt is done: the full blocks it computed (never decode-generated ones) go to their
pool ranks as messages, sent without waiting (ranks/ems/pool.py says why two-sided).

A pool rank lost (an ems.faults dead row): its status word, read after every record table and
every pull, says LOST (what a UB read of a dead server completes with). The die declares it
lost, throws away what it read there, recomputes from that block on (a fallback, named in the
log: die, pool rank, event) and places keys on the other pool ranks from then on. The die's
waits on a pool rank (an evict row's answer, its sends at the end) are bounded by run.timeout_s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
from mpi4py import MPI

from ranks.core.control import WaitTimeout
from ranks.core.tags import TAG_EMS, TAG_EMS_EVICTED
from ranks.ems.messages import EmsDone, EmsEvict, EmsEvicted, EmsPut, EmsTouch
from xds_mpi.config.hardware import load_profile
from xds_mpi.ems.cache import Record, RecordTable, Ring, block_keys, lookup_blocks, verified
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.ems import LOST, RECORD_WORDS, STATUS_OFFSET, WORD_BYTES
from xds_mpi.plan.kv_memory import projected_kv_bytes
from xds_mpi.results.request_pricing import planes


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
        self.cache, self.log = cache, ctx.log
        self.timeout_s = ctx.cfg.run.timeout_s
        self.ub = _ub_plane(ctx.cfg)
        self.big = cost_shape()
        self.kv_int8 = ctx.cfg.scheduler.kv_int8
        self.first_ring = Ring(self.ems.pool)  # every pool rank: where a key was placed
        self.ring: Ring | None = self.first_ring  # the ranks not lost; None: every one lost
        self.lost: set[int] = set()  # pool ranks this die declared lost
        self.evict_at = self.ems.evict_lookups(ctx.comm.rank)  # ems.faults evict rows
        self.num_finding = 0  # lookups that found a block (an evict row's count)
        self.bases = {r: ctx.plan.p2p.window_bytes(r) for r in self.ems.pool}
        self.keys: dict[int, list[int]] = {}  # req_id -> its prompt's full blocks' keys
        self.hit_blocks: dict[int, int] = {}  # req_id -> blocks pulled (until its put)
        self.hit_tokens: dict[int, int] = {}  # req_id -> prompt tokens pulled (the report)
        self.looked_up: set[int] = set()  # requests looked up here until their put or cancel
        self.sends: list[tuple[int, str, MPI.Request]] = []  # (pool rank, event, request)
        self.stats = {
            "lookups": 0,
            "requests_hit": 0,
            "blocks_hit": 0,
            "bytes_pulled": 0,
            "tokens_skipped": 0,
            "fallbacks": 0,
            "lost_fallbacks": 0,
            "evicts_injected": 0,
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
        fallbacks_before = self.stats["fallbacks"]
        records: dict[int, RecordTable | None] = {}
        payloads = []
        for key in wanted:
            if self.ring is None:  # every pool rank lost: what they held is recomputed
                self._fell_back(is_lost=True)
                break
            owner = self.ring.owner(key)
            if owner not in records:
                records[owner] = self._records(owner, "records read")
            found = records[owner].find(key) if records[owner] is not None else None
            if found is None:  # absent: a miss; at a key placed on a lost pool rank: a fallback
                if owner in self.lost or self.first_ring.owner(key) in self.lost:
                    self._fell_back(is_lost=True)
                break
            if not payloads:
                self._evict_if_due(owner, key)
            payload = self._pull(owner, key, *found)
            if payload is None:  # the record moved under the pull, or the pool rank is lost
                self._fell_back(is_lost=owner in self.lost)
                break
            payloads.append(payload)
        self.num_finding += bool(payloads) or self.stats["fallbacks"] > fallbacks_before
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
        records: dict[int, RecordTable | None] = {}
        num = 0
        for key in keys[: lookup_blocks(len(req.prompt), self.ems.block_tokens)]:
            if self.ring is None:
                break
            owner = self.ring.owner(key)
            if owner not in records:
                records[owner] = self._records(owner, "probe")
            if records[owner] is None or records[owner].find(key) is None:
                break
            num += 1
        return num * self.ems.block_tokens

    def _records(self, owner: int, event: str) -> RecordTable | None:
        """`owner`'s records (one Get); None: `owner` is lost."""
        words = np.empty(self.ems.capacity * RECORD_WORDS, np.uint64)
        self.mem.get(owner, self.bases[owner] + self.ems.record_offset(0), words)
        self.mem.flush(owner)
        if self._is_lost(owner, event):
            return None
        return RecordTable(words, self.ems.capacity)

    def _pull(self, owner: int, key: int, slot: int, before: Record) -> np.ndarray | None:
        """The slot's payload if it is still `key`'s after the pull, else None."""
        out = np.empty(self.ems.block_bytes, np.uint8)
        self.mem.get(owner, self.bases[owner] + self.ems.payload_offset(slot), out)
        self.mem.flush(owner)
        version_at = self.bases[owner] + self.ems.record_offset(slot) + WORD_BYTES
        after = self.mem.fetch_word(owner, version_at)
        if self._is_lost(owner, "payload pull"):
            return None
        return out if verified(key, self.ems.block_bytes, before, after) else None

    def _is_lost(self, owner: int, event: str) -> bool:
        """`owner`'s status word read after what was read there: LOST declares it lost (once,
        logged naming this die, the pool rank and the event)."""
        if owner in self.lost:
            return True
        if self.mem.fetch_word(owner, self.bases[owner] + STATUS_OFFSET) != LOST:
            return False
        self.lost.add(owner)
        survivors = [r for r in self.ems.pool if r not in self.lost]
        self.ring = Ring(survivors) if survivors else None
        self.log.warning(
            f"die rank {self.comm.rank}: EMS pool rank {owner} lost (event: {event}); "
            f"what it held is recomputed, keys placed on pool ranks {survivors} from now on"
        )
        return True

    def _fell_back(self, *, is_lost: bool) -> None:
        """The prefix ends at a record that moved under the pull or at a lost pool rank: what
        the pool would have given from there is recomputed."""
        self.stats["fallbacks"] += 1
        self.stats["lost_fallbacks"] += is_lost

    def _evict_if_due(self, owner: int, key: int) -> None:
        """An ems.faults evict row: `owner` evicts `key` between its record read and its pull;
        the die waits for the answer (bounded: the pool rank's status is read meanwhile, a
        lost one ends the wait)."""
        if self.num_finding not in self.evict_at:
            return
        self._send(EmsEvict(key=key, rank=self.comm.rank), owner, "evict")
        deadline = time.monotonic() + self.timeout_s
        while (msg := self.comm.improbe(source=owner, tag=TAG_EMS_EVICTED)) is None:
            if self._is_lost(owner, "evict answer"):
                return
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"die rank {self.comm.rank}: no answer from EMS pool rank {owner} "
                    f"to evict {key:#x} (event: evict answer) within "
                    f"run.timeout_s({self.timeout_s:g})"
                )
            time.sleep(0.0005)
        answer: EmsEvicted = msg.recv()  # was_held False: the LRU took it first, as bad
        self.stats["evicts_injected"] += answer.was_held

    def _touch(self, keys: list[int]) -> None:
        by_owner: dict[int, list[int]] = {}
        for key in keys:
            by_owner.setdefault(self.ring.owner(key), []).append(key)
        for owner, owned in by_owner.items():
            self._send(EmsTouch(keys=tuple(owned)), owner, "touch")

    def pull_arrivals(self, scheduler, pricer) -> None:
        """A colocated die's lookups: each request waiting on `scheduler` not looked up yet, its
        prefix held (`hold_prefix`). A request looked up that is neither waiting nor running any
        more was cancelled (or left with a lost die) before its put: what was held for it (its
        keys, its pulled blocks waiting for an admission) is dropped, or a server holds it for
        as long as it serves."""
        here = {req.req_id for req in scheduler.waiting} | scheduler.running.keys()
        for req_id in self.looked_up - here:
            self.forget(req_id, scheduler)
        for req in scheduler.waiting:
            if req.req_id not in self.looked_up:
                self.looked_up.add(req.req_id)
                self.hold_prefix(req, scheduler, pricer)

    def forget(self, req_id: int, scheduler) -> None:
        """Drop what this die holds for `req_id` (it will not be put)."""
        self.looked_up.discard(req_id)
        self.keys.pop(req_id, None)
        self.hit_blocks.pop(req_id, None)
        scheduler.prefix_hits.pop(req_id, None)

    def hold_prefix(self, req, scheduler, pricer) -> None:
        """`lookup`, the pull priced on the die's projected clock (`pricer`), and the hit held
        for `scheduler`'s admission (`DieScheduler.prefix_hits`): prefill and colocated dies."""
        hit = self.lookup(req)
        if hit is not None:
            pricer.pool_pull(self.pull_s(hit))
            num_tokens = hit.num_blocks * self.ems.block_tokens
            scheduler.prefix_hits[req.req_id] = (num_tokens, partial(self.write, hit))

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
        self.looked_up.discard(req.req_id)
        keys = self.keys.pop(req.req_id, None)
        if keys is None:
            keys = block_keys(req.prompt, self.ems.block_tokens, self.ems.namespace)
        first = self.hit_blocks.pop(req.req_id, 0)
        if self.ring is None:
            return
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
            self._send(msg, owner, "put")
            self.stats["blocks_put"] += len(blocks)
            self.stats["bytes_put"] += msg.payload.nbytes

    def _send(self, msg, owner: int, event: str) -> None:
        self.sends.append((owner, event, self.comm.isend(msg, dest=owner, tag=TAG_EMS)))

    def close(self) -> dict:
        """Tell every pool rank this die is done (on the puts' tag: it arrives after them; a
        lost one too, so that the emulating process can leave); the stats. The sends' wait is
        bounded by run.timeout_s and names the pool ranks and events still pending."""
        for owner in self.ems.pool:
            self._send(EmsDone(rank=self.comm.rank), owner, "done")
        deadline = time.monotonic() + self.timeout_s
        while not MPI.Request.Testall([req for _, _, req in self.sends]):
            if time.monotonic() > deadline:
                pending = sorted({(o, e) for o, e, r in self.sends if not r.Test()})
                raise WaitTimeout(
                    f"die rank {self.comm.rank}: sends to EMS pool ranks not completed "
                    f"within run.timeout_s({self.timeout_s:g}): (pool rank, event) {pending}"
                )
            time.sleep(0.001)
        return {**self.stats, "hit_tokens": dict(self.hit_tokens), "lost": sorted(self.lost)}


def _ub_plane(cfg):
    """The UB plane of the prefill dies' hardware profile (a pool server's DRAM over UB)."""
    return planes(load_profile(cfg.pd.prefill_profile or cfg.hardware.profile))["UB"]
