"""Where dispatch / combine rows are staged in this die's window and pulled from a peer's
(xccl/ep/buffer.py, xDeepServe §3.2, Figure 7).

Staging writes our own window's dispatch or combine area (xccl/moe_layout.py EpLayout) and ends
with a Win.Sync so the stores land before a record tells a peer to pull them. Pulls Get each
member's rows (dispatch rows: in runs, straight into slot order) and flush them all before the
rows are read.
"""

from __future__ import annotations

import numpy as np

from xccl.gmem import DieMemory
from xccl.moe_layout import INDEX_BYTES, INDEX_DTYPE, EpLayout
from xccl.quant import encode_rows


class EpRows:
    """Staging and pulling of one EP group's rows on this die's window."""

    def __init__(
        self,
        mem: DieMemory,
        layout: EpLayout,
        dtype,
        slot_owner: np.ndarray,
        member_of_rank: np.ndarray,
    ) -> None:
        self.mem, self.layout, self.me, self.members = mem, layout, mem.rank, layout.members
        self.dtype = np.dtype(dtype)
        self.slot_owner = slot_owner  # [num slots] -> rank
        self.member_of_rank = member_of_rank  # [max rank + 1] -> member idx, -1 = not a member

    def stage_dispatch(self, x: np.ndarray, phy: np.ndarray):
        """Stage x's rows, one per chosen slot, destination-major, with their index rows.
        Returns token, column [S] of each staged row and send_counts [num_members]."""
        token, column = np.nonzero(phy >= 0)  # [S] each
        slot = phy[token, column]
        dest = self.member_of_rank[self.slot_owner[slot]]
        order = np.lexsort((column, token, slot, dest))
        token, column, slot, dest = token[order], column[order], slot[order], dest[order]
        layout, local, num_rows = self.layout, self.mem.local, len(token)
        start = layout.offset(self.me, "dispatch_rows")
        staged = local[start : start + num_rows * layout.send_row_bytes].reshape(
            num_rows, layout.send_row_bytes
        )  # [S, row bytes] in window
        encode_rows(
            staged, x, token, hidden=layout.hidden, use_int8=layout.use_int8, dtype=self.dtype
        )
        index = np.zeros(num_rows, INDEX_DTYPE)
        index["token"], index["column"], index["slot"] = token, column, slot
        start = layout.offset(self.me, "dispatch_index")
        local[start : start + index.nbytes] = index.view(np.uint8)
        self.mem.sync()  # our stores land before any peer is told to pull them
        return token, column, np.bincount(dest, minlength=len(self.members))

    def pull_dispatch_index(self, counts, offsets) -> np.ndarray:
        """Our dispatch rows' index rows [R], member-major (the order pulled)."""
        index = np.empty(int(counts.sum()), INDEX_DTYPE)
        raw = index.view(np.uint8).reshape(len(index), INDEX_BYTES)
        self._pull(raw, "dispatch_index", counts, offsets, INDEX_BYTES)
        return index

    def pull_dispatch_rows(self, counts, offsets, perm: np.ndarray) -> np.ndarray:
        """Our dispatch rows [R, send_row_bytes] (encoded), already in `perm` order (perm:
        member-major position of each output row). Each run of rows that is contiguous on both
        sides is one Get (a member's rows for one slot), so no reordering copy follows."""
        row_bytes, num_rows = self.layout.send_row_bytes, int(counts.sum())
        rows = np.empty((num_rows, row_bytes), np.uint8)
        if not num_rows:
            return rows
        dest = np.empty(num_rows, np.int64)
        dest[perm] = np.arange(num_rows)  # where each pulled row goes
        member = np.repeat(np.arange(len(self.members)), counts)
        first = np.cumsum(counts) - counts  # [members] each member's first pulled row
        source_row = np.arange(num_rows) + np.repeat(np.asarray(offsets, np.int64) - first, counts)
        cut = np.flatnonzero((dest[1:] - dest[:-1] != 1) | (member[1:] != member[:-1])) + 1
        starts, ends = np.concatenate(([0], cut)), np.concatenate((cut, [num_rows]))
        for a, b, m, src, dst in zip(
            starts.tolist(),
            ends.tolist(),
            member[starts].tolist(),
            source_row[starts].tolist(),
            dest[starts].tolist(),
        ):
            rank = self.members[m]
            at = self.layout.offset(rank, "dispatch_rows") + src * row_bytes
            self.mem.get(rank, at, rows[dst : dst + b - a].reshape(-1))
        self.mem.flush_all()
        return rows

    def stage_combine(self, expert_out: np.ndarray, recv_perm: np.ndarray) -> None:
        """Stage outputs [R, hidden] in our combine area, by source die, in the order each source
        staged them (recv_perm: where each received row sits in that order)."""
        start, num_rows = self.layout.offset(self.me, "combine_rows"), len(expert_out)
        staged = self.mem.local[start : start + num_rows * self.layout.out_row_bytes]
        staged.view(self.dtype).reshape(num_rows, self.layout.hidden)[recv_perm] = expert_out
        self.mem.sync()

    def pull_combine(self, counts, offsets) -> np.ndarray:
        """Our dispatched rows' outputs [R, hidden] (self.dtype), member-major."""
        outs = np.empty((int(counts.sum()), self.layout.hidden), self.dtype)
        self._pull(
            outs.view(np.uint8).reshape(len(outs), self.layout.out_row_bytes),
            "combine_rows",
            counts,
            offsets,
            self.layout.out_row_bytes,
        )
        return outs

    def _pull(self, out: np.ndarray, region: str, counts, offsets, row_bytes: int) -> None:
        """Get counts[i] rows of `row_bytes` from member i's `region` at row offsets[i]."""
        at = 0
        for rank, count, offset in zip(self.members, counts.tolist(), offsets.tolist()):
            if count:  # Python ints: a numpy scalar a member cost more than its Get at 64 dies
                self.mem.get(
                    rank,
                    self.layout.offset(rank, region) + offset * row_bytes,
                    out[at : at + count].reshape(-1),
                )
                at += count
        self.mem.flush_all()
