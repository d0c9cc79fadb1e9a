"""The JE's global prompt tree (DeepServe §5.2; docs/routing.md): which TE holds the KV of which
prompt prefix, as the JE can know it from the prompts it routed.

A node is one full KV block of a prompt, keyed as a TE's context cache keys it
(xds_mpi/ems/cache.py `block_keys`: a hash chained over the prompt's blocks, so a key names its
whole prefix and a dict of keys is the tree). Each node lists the TEs that hold it. Routing a
prompt to a TE makes the TE hold every full block of it; a TE holds at most its capacity in
blocks and drops the least recently used first, as its pool does. `matched_tokens(req, te)`: the
tokens of `req`'s prompt that TE would take from its cache, its leading held blocks before the
prompt's last token (that token is always computed: xds_mpi/ems/cache.py `lookup_blocks`).

What it models, and what it does not: the TE's pool puts a prompt's blocks when its prefill ends,
the tree when the JE routes it, so a request routed before an earlier one's prefill ended is
credited blocks the TE may not hold yet; a pool of several servers evicts per server (each its
own LRU over the keys the ring gives it), the tree per TE over the sum.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from xds_mpi.ems.cache import block_keys, lookup_blocks
from xds_mpi.workload.requests import Request

if TYPE_CHECKING:
    from xds_mpi.config.schema import Config

NAMESPACE = b"je-tree/"  # any fixed seed: the tree's keys are compared with its own only


def te_capacity_blocks(cfg: Config, num_dies: int) -> int:
    """The blocks one TE keeps for reuse, as the tree models it: its EMS pool (ems.capacity_blocks
    x ems.servers) with ems.enabled, else its dies' KV blocks (num_kv_blocks_per_die x dies: what
    a TE reusing its own KV could keep at most; this version's TEs reuse only through EMS)."""
    if cfg.ems.enabled:
        return cfg.ems.capacity_blocks * cfg.ems.servers
    return cfg.scheduler.num_kv_blocks_per_die * max(num_dies, 1)


class PromptTree:
    """num_tes TEs' cached prompt blocks of block_tokens tokens; capacity_blocks: per TE (one
    value for every TE, or one each)."""

    def __init__(
        self,
        num_tes: int,
        *,
        block_tokens: int,
        capacity_blocks: int | Sequence[int],
        namespace: bytes = NAMESPACE,
    ) -> None:
        if isinstance(capacity_blocks, int):
            capacity_blocks = [capacity_blocks] * num_tes
        if len(capacity_blocks) != num_tes or min(capacity_blocks) < 1:
            raise ValueError(
                f"prompt tree: capacity_blocks {list(capacity_blocks)} must be >= 1 for each of "
                f"{num_tes} TEs"
            )
        self.block_tokens, self.namespace = block_tokens, namespace
        self.max_blocks = tuple(capacity_blocks)
        self.holders: dict[int, set[int]] = {}  # block key -> the TEs holding it
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_tes)]
        self.num_evicted = [0] * num_tes
        self._keys_of: tuple[int, list[int]] = (-1, [])  # (req_id, its keys): the last asked

    def keys(self, req: Request) -> list[int]:
        """The keys of every full block of `req`'s prompt (remembered for the last request:
        a decision asks once per TE)."""
        if self._keys_of[0] != req.req_id:
            self._keys_of = (req.req_id, block_keys(req.prompt, self.block_tokens, self.namespace))
        return self._keys_of[1]

    def matched_blocks(self, req: Request, te: int) -> int:
        """The leading blocks of `req`'s prompt before its last token that `te` holds."""
        num = 0
        for key in self.keys(req)[: lookup_blocks(len(req.prompt), self.block_tokens)]:
            if te not in self.holders.get(key, ()):
                break
            num += 1
        return num

    def matched_tokens(self, req: Request, te: int) -> int:
        return self.matched_blocks(req, te) * self.block_tokens

    def route(self, req: Request, te: int) -> None:
        """`req` routed to `te`: its blocks the most recently used there, the least recently
        used past the capacity evicted."""
        lru = self.lru[te]
        for key in self.keys(req):
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = None
            self.holders.setdefault(key, set()).add(te)
            if len(lru) > self.max_blocks[te]:
                self._evict(te, lru.popitem(last=False)[0])

    def _evict(self, te: int, key: int) -> None:
        holders = self.holders[key]
        holders.discard(te)
        if not holders:
            del self.holders[key]
        self.num_evicted[te] += 1

    def num_held(self, te: int) -> int:
        return len(self.lru[te])
