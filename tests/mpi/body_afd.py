"""XCCL A2E/E2A (trampolines and direct) and the persistent expert loop against the oracles.

Rank r < D*G is attention die r (domain-major), the next E ranks are expert dies; other ranks only
allocate an empty window. Rows name their source: column 0 = attention rank, column 1 = token.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from xccl.afd.buffer import AfdBuffer, AfdCall
from xccl.afd.loop import ExpertLoop
from xccl.errors import XcclTimeout
from xccl.gmem import DieMemory
from xccl.moe_layout import AfdLayout
from xccl.reference import a2e_metadata_writes, a2e_reference, e2a_reference

comm = MPI.COMM_WORLD
HIDDEN, MAX_TOKENS, TOP_K, EXPERTS_PER_DIE = 16, 12, 2, 3
NUM_LAYERS, NUM_MICROBATCHES = 2, 2


class Deployment:
    """D domains x G attention dies, E expert dies (the last `num_shared_dies` hold only the
    shared expert; otherwise every expert die holds a shared slot), expert 0 with 2 replicas."""

    def __init__(self, domains, groups, experts, *, trampolines, use_int8=False, num_shared_dies=0):
        self.domains, self.groups = domains, groups
        self.attention = tuple(range(domains * groups))
        self.experts = tuple(range(len(self.attention), len(self.attention) + experts))
        self._place_slots(num_shared_dies)
        self.dedicated = bool(num_shared_dies)
        self.trampolines, self.use_int8 = trampolines, use_int8
        self.layout = self._layout()
        self.role = (
            "attention"
            if comm.rank in self.attention
            else "expert"
            if comm.rank in self.experts
            else "idle"
        )
        size = self.layout.area_bytes(self.role) if self.role != "idle" else 0
        self.mem = DieMemory(comm, size)
        self.buf = (
            AfdBuffer(
                self.mem,
                self.layout,
                self.slot_owner,
                num_routed_slots=self.num_routed_slots,
                use_trampolines=trampolines,
                timeout_s=30,
            )
            if self.role != "idle"
            else None
        )

    def _place_slots(self, num_shared_dies):
        """Routed experts EXPERTS_PER_DIE per routed die, expert 0's replica on the last of them,
        then one shared slot per shared die."""
        num_dies = len(self.experts)
        routed_dies = self.experts[: num_dies - num_shared_dies]
        self.num_experts = EXPERTS_PER_DIE * len(routed_dies)
        slot_owner = [r for r in routed_dies for _ in range(EXPERTS_PER_DIE)]
        self.log2phy = [(e,) for e in range(self.num_experts)]
        self.log2phy[0] = (0, len(slot_owner))  # a replica on the last routed die
        slot_owner.append(routed_dies[-1])
        self.num_routed_slots = len(slot_owner)
        shared_dies = (
            self.experts[num_dies - num_shared_dies :] if num_shared_dies else self.experts
        )
        self.shared_slot_of = {r: len(slot_owner) + i for i, r in enumerate(shared_dies)}
        self.slot_owner = slot_owner + list(shared_dies)

    def _layout(self):
        return AfdLayout(
            attention=self.attention,
            experts=self.experts,
            group_size=self.groups,
            base=(0,) * comm.size,
            num_lanes=self.domains * NUM_MICROBATCHES,
            hidden=HIDDEN,
            max_tokens=MAX_TOKENS,
            top_k=TOP_K,
            has_shared=True,
            itemsize=8,
            use_int8=self.use_int8,
        )

    def shared_slots(self, rank):
        if self.dedicated or not self.trampolines:
            return tuple(self.shared_slot_of.values())
        return (self.shared_slot_of[self.experts[self.attention.index(rank) % self.groups]],)

    def calls(self, idle_domain=-1):
        """Layer-major, then domain, then microbatch; an idle domain takes no calls."""
        calls = []
        for layer in range(NUM_LAYERS):
            for d in range(self.domains):
                if d == idle_domain:
                    continue
                for m in range(NUM_MICROBATCHES):
                    calls.append(
                        AfdCall(
                            call=len(calls),
                            lane=d * NUM_MICROBATCHES + m,
                            domain=d,
                            event_id=1000 + 10 * len(calls) + layer,
                        )
                    )
        return calls

    def close(self):
        comm.Barrier()
        self.mem.free()


def batch(rank, call, num_experts):
    """Uneven load: token count varies by die and call; attention die 0 always sends nothing.
    Expert -1 (no expert) and repeated experts occur."""
    rng = np.random.default_rng((rank, call.call))
    num_tokens = 0 if rank == 0 else (rank * 5 + call.call * 3) % (MAX_TOKENS + 1)
    x = rng.normal(size=(num_tokens, HIDDEN))
    x[:, 0], x[:, 1] = rank, np.arange(num_tokens)
    topk = rng.integers(-1, num_experts, size=(num_tokens, TOP_K))
    return x, topk, rng.random((num_tokens, TOP_K))


def expert_fn(slot, rows):
    return rows * (slot + 1.5) + slot  # distinct per slot: a misrouted row shows


def serve_calls(dep, calls):
    """Attention dies: per layer, issue every microbatch's A2E, then complete each E2A.
    Expert dies: one persistent loop over every call. Returns what each side saw."""
    sent, ys, computed = {}, {}, []
    if dep.role == "attention":
        domain = dep.attention.index(comm.rank) // dep.groups
        mine = [c for c in calls if c.domain == domain]
        for at in range(0, len(mine), NUM_MICROBATCHES):
            handles = []
            for call in mine[at : at + NUM_MICROBATCHES]:
                x, topk, w = batch(comm.rank, call, dep.num_experts)
                sent[call.call] = (x, topk, w)
                handles.append(
                    dep.buf.a2e(
                        x,
                        topk,
                        w,
                        call,
                        log2phy=dep.log2phy,
                        shared_slots=dep.shared_slots(comm.rank),
                    )
                )
            for h in handles:  # overlap: all issued first
                ys[h.call.call] = dep.buf.e2a(h)
    elif dep.role == "expert":

        def compute(call, slot, rows):
            computed.append((call.call, slot, rows.copy()))
            return expert_fn(slot, rows)

        ExpertLoop(dep.buf, compute, timeout_s=30).run(calls)
    return sent, ys, computed


def check_against_oracle(dep, calls, sent, ys, computed):
    everything = comm.allgather(sent)  # [rank] -> {call: (x, topk, w)}
    for call in calls:
        senders = dep.buf.domain_attention(call.domain) if dep.buf else ()
        inputs = [everything[r][call.call] for r in senders]
        if not inputs:
            continue
        xs, topks, ws = zip(*inputs)
        shared = [dep.shared_slots(r) for r in senders]
        if dep.role == "attention" and call.call in ys:
            i = senders.index(comm.rank)
            want = e2a_reference(
                xs, topks, ws, dep.log2phy, shared[i], senders, expert_fn, use_int8=dep.use_int8
            )[i]
            assert np.array_equal(ys[call.call], want), (
                f"call {call.call}: E2A differs by {np.abs(ys[call.call] - want).max()}"
            )
        if dep.role == "expert":
            want = {}
            for i, src in enumerate(senders):  # per-source shared slots: one oracle per source
                got = a2e_reference(
                    xs[i : i + 1],
                    topks[i : i + 1],
                    dep.log2phy,
                    shared[i],
                    dep.slot_owner,
                    (src,),
                    dep.experts,
                    use_int8=dep.use_int8,
                )[comm.rank]
                for slot in np.unique(got["slot"]):
                    want.setdefault(int(slot), []).append(got["x"][got["slot"] == slot])
            seen = {slot: rows for c, slot, rows in computed if c == call.call}
            assert sorted(seen) == sorted(want), (
                f"call {call.call}: slots {sorted(seen)} != {sorted(want)}"
            )
            for slot, rows in seen.items():
                assert np.array_equal(rows, np.concatenate(want[slot])), (
                    f"call {call.call} slot {slot}: rows differ from the oracle"
                )


DEPLOYMENTS = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (1, 3, 5), (2, 2, 3), (2, 2, 4)]


def dies_needed(shape):
    return shape[0] * shape[1] + shape[2]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", DEPLOYMENTS, ids=lambda s: "D{}G{}E{}".format(*s))
@pytest.mark.parametrize("trampolines", [True, False], ids=["trampoline", "direct"])
def test_a2e_e2a_match_the_oracle(shape, trampolines):
    if dies_needed(shape) > comm.size:
        pytest.skip(f"needs {dies_needed(shape)} ranks")
    dep = Deployment(*shape, trampolines=trampolines, use_int8=shape == (2, 2, 3))
    try:
        calls = dep.calls()
        check_against_oracle(dep, calls, *serve_calls(dep, calls))
        sent_calls = sum(
            1
            for c in calls
            if dep.role == "attention" and comm.rank in dep.buf.domain_attention(c.domain)
        )
        writes = a2e_metadata_writes(
            len(dep.attention), len(dep.experts), dep.groups, use_trampolines=trampolines
        )
        if dep.role == "attention":
            assert dep.buf.counters.metadata_writes == writes["attention"] * sent_calls
        elif dep.role == "expert":
            kind = "trampoline" if dep.buf.is_trampoline else "expert"
            assert dep.buf.counters.metadata_writes == writes[kind] * len(calls)
    finally:
        dep.close()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("trampolines", [True, False], ids=["trampoline", "direct"])
def test_dedicated_shared_die_idle_domain_and_int8(trampolines):
    shape = (2, 1, 2) if comm.size < 8 else (2, 2, 4)
    dep = Deployment(*shape, trampolines=trampolines, use_int8=True, num_shared_dies=1)
    try:
        calls = dep.calls(idle_domain=1)  # domain 1 has no requests this iteration
        check_against_oracle(dep, calls, *serve_calls(dep, calls))
    finally:
        dep.close()


@pytest.mark.mpi(min_size=2)
def test_a_missing_attention_die_times_out_naming_it():
    dep = Deployment(1, 1, 1, trampolines=True)
    try:
        if dep.role == "expert":
            loop = ExpertLoop(dep.buf, lambda c, s, r: r, timeout_s=0.3)
            with pytest.raises(
                XcclTimeout,
                match=r"A2E event 1000 \(call 0.*no record from "
                r"rank\(s\) \[0\]",
            ):
                loop.run(dep.calls()[:1])
    finally:
        dep.close()
