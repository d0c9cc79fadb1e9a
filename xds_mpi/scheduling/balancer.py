"""The TE-shell's decode DP load balancer (xDeepServe §4.3).

Skip DP groups at their batch limit; among the rest pick the one with the lowest KV-cache use,
counting the space each request reserves for its whole output. Pending counts and reservations
change on dispatch and completion; the shell's own accounting is exact, so the dies send no KV
statistics (one message per die and iteration saved).
"""

from __future__ import annotations

from collections.abc import Sequence

from xds_mpi.workload.requests import Request, kv_tokens_needed


class DecodeBalancer:
    def __init__(
        self,
        groups: Sequence[int],
        *,
        max_batch: int,
        kv_capacity_tokens: int,
        block_tokens: int,
        mtp_depth: int = 0,
    ) -> None:
        self.groups = tuple(groups)
        self.max_batch, self.capacity, self.block_tokens = (
            max_batch,
            kv_capacity_tokens,
            block_tokens,
        )
        self.mtp_depth = mtp_depth
        self.num_pending = {g: 0 for g in self.groups}  # requests dispatched, not finished
        self.reserved = {g: 0 for g in self.groups}  # KV tokens reserved (prompt + output)
        self._where: dict[int, tuple[int, int]] = {}

    def _reserve(self, req: Request) -> int:
        return -(-kv_tokens_needed(req, self.mtp_depth) // self.block_tokens) * self.block_tokens

    def pick(self, req: Request) -> int | None:
        """The DP group to serve `req`, or None while every group is full."""
        need = self._reserve(req)
        open_groups = [
            g
            for g in self.groups
            if self.num_pending[g] < self.max_batch and self.reserved[g] + need <= self.capacity
        ]
        if not open_groups:
            return None
        return min(open_groups, key=lambda g: (self.reserved[g], self.num_pending[g], g))

    def on_dispatch(self, group: int, req: Request) -> None:
        need = self._reserve(req)
        self.num_pending[group] += 1
        self.reserved[group] += need
        self._where[req.req_id] = (group, need)

    def on_complete(self, req_id: int) -> int:
        group, need = self._where.pop(req_id)
        self.num_pending[group] -= 1
        self.reserved[group] -= need
        return group

    def remove_group(self, group: int) -> tuple[int, ...]:
        """Vertical scaling (§6.2 stage 2): `group` is lost; no request goes there any more.
        Returns the ids of the requests it held unfinished (to be served elsewhere)."""
        orphans = tuple(sorted(r for r, (g, _) in self._where.items() if g == group))
        for req_id in orphans:
            self.on_complete(req_id)
        self.groups = tuple(g for g in self.groups if g != group)
        del self.num_pending[group], self.reserved[group]
        return orphans
