"""XCCL dispatch/combine against the single-process oracle at any rank count."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from xccl.ep.buffer import EpBuffer
from xccl.errors import BufferTooSmall, EventMismatch, XcclError
from xccl.gmem import DieMemory
from xccl.moe_layout import EpLayout
from xccl.reference import combine_reference, dispatch_reference

comm = MPI.COMM_WORLD
MEMBERS = tuple(range(comm.size))
HIDDEN, MAX_TOKENS, TOP_K = 16, 24, 3
EXPERTS_PER_DIE = 12
NUM_EXPERTS = EXPERTS_PER_DIE * comm.size


def plain_placement():
    """Expert e on slot e, owned by die e // EXPERTS_PER_DIE; no replicas."""
    return [r for r in MEMBERS for _ in range(EXPERTS_PER_DIE)], [(e,) for e in range(NUM_EXPERTS)]


class Group:
    def __init__(self, slot_owner, *, shared=0, use_int8=False):
        self.layout = EpLayout(
            members=MEMBERS,
            base=(0,) * comm.size,
            hidden=HIDDEN,
            max_tokens=MAX_TOKENS,
            num_columns=TOP_K + (1 if shared else 0),
            itemsize=8,
            use_int8=use_int8,
        )
        self.mem = DieMemory(comm, self.layout.area_bytes())
        self.ep = EpBuffer(self.mem, self.layout, slot_owner, timeout_s=30)
        self.slot_owner, self.use_int8 = slot_owner, use_int8

    def close(self):
        comm.Barrier()
        self.mem.free()


@pytest.fixture
def group_factory():
    groups = []

    def make(*args, **kwargs):
        groups.append(Group(*args, **kwargs))
        return groups[-1]

    yield make
    for g in groups:
        g.close()


def batch(seed: int, num_tokens: int, *, skew: float = 0.0):
    """Rows that name their source: column 0 = rank, column 1 = token index, then noise."""
    rng = np.random.default_rng((seed, comm.rank))
    x = rng.normal(size=(num_tokens, HIDDEN))
    x[:, 0], x[:, 1] = comm.rank, np.arange(num_tokens)
    topk = np.array(
        [rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(num_tokens)], np.int64
    ).reshape(num_tokens, TOP_K)
    if skew:  # the hot expert 0 takes column 0 of most tokens (§4.5: 30x the average)
        hot = rng.random(num_tokens) < skew
        topk[hot] = np.where(topk[hot] == 0, topk[hot, :1], topk[hot])
        topk[hot, 0] = 0
    weights = rng.random((num_tokens, TOP_K))
    return x, topk, weights


def expert_fn(slot, rows):
    return rows * (slot + 1.5) + slot  # distinct per slot, so a misrouted row shows


def check_round(group, x, topk, w, log2phy, shared_slots=(), event=1):
    recv_x, info, handle = group.ep.dispatch(
        x, topk, w, event, log2phy=log2phy, shared_slots=shared_slots
    )
    gathered = comm.allgather((x, topk, w))
    xs, topks, ws = zip(*gathered)
    want = dispatch_reference(
        xs, topks, log2phy, shared_slots, group.slot_owner, MEMBERS, use_int8=group.use_int8
    )[comm.rank]
    assert np.array_equal(info.src_rank, want["src_rank"]), "rows from the wrong dies"
    assert np.array_equal(info.src_token, want["src_token"])
    assert np.array_equal(info.src_column, want["src_column"])
    assert np.array_equal(recv_x, want["x"]), "row payloads differ from the oracle"
    slot_of_row = np.repeat(info.local_slots, info.num_rows_per_slot)
    assert np.array_equal(slot_of_row, want["slot"])
    out = (
        np.concatenate([expert_fn(s, recv_x[slot_of_row == s]) for s in info.local_slots])
        if len(recv_x)
        else np.zeros((0, HIDDEN))
    )
    y = group.ep.combine(out, handle)
    y_want = combine_reference(
        xs, topks, ws, log2phy, shared_slots, MEMBERS, expert_fn, use_int8=group.use_int8
    )[comm.rank]
    assert np.array_equal(y, y_want), f"combine differs by {np.abs(y - y_want).max()}"
    return recv_x, info


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("skew", [0.0, 0.9])
def test_uniform_and_skewed_routing_match_the_oracle(group_factory, skew):
    slot_owner, log2phy = plain_placement()
    group = group_factory(slot_owner)
    x, topk, w = batch(1, MAX_TOKENS, skew=skew)
    recv_x, info = check_round(group, x, topk, w, log2phy)
    rows_per_slot = np.concatenate(comm.allgather(info.num_rows_per_slot))  # [experts]
    assert rows_per_slot.sum() == MAX_TOKENS * TOP_K * comm.size
    if skew:  # expert 0 takes ~0.9 of all tokens: 0.9 x experts / top-k times the mean
        ratio = rows_per_slot[0] / rows_per_slot.mean()
        assert ratio > 0.8 * 0.9 * NUM_EXPERTS / TOP_K, f"hot expert only {ratio:.1f}x the mean"


@pytest.mark.mpi(min_size=2)
def test_a_die_with_zero_tokens_still_takes_part(group_factory):
    slot_owner, log2phy = plain_placement()
    group = group_factory(slot_owner)
    x, topk, w = batch(2, 0 if comm.rank == 0 else 7)
    check_round(group, x, topk, w, log2phy)


@pytest.mark.mpi(min_size=2)
def test_replicas_spread_tokens_by_position(group_factory):
    # Expert 0 has a replica on every die (slots after the primaries).
    slot_owner, log2phy = plain_placement()
    replicas = list(range(NUM_EXPERTS, NUM_EXPERTS + comm.size))
    slot_owner = slot_owner + list(MEMBERS)
    log2phy = [(0, *replicas)] + log2phy[1:]
    group = group_factory(slot_owner)
    x, topk, w = batch(3, MAX_TOKENS, skew=1.0)
    _, info = check_round(group, x, topk, w, log2phy)
    served = comm.allgather(
        int(info.num_rows_per_slot[info.local_slots.index(NUM_EXPERTS + comm.rank)])
    )
    assert min(served) > 0, f"replica rows per die {served}: some replica got nothing"


@pytest.mark.mpi(min_size=2)
def test_dedicated_shared_expert_dies(group_factory):
    # The last die hosts one shared-expert slot beside its routed ones (EP288 style).
    slot_owner, log2phy = plain_placement()
    shared_slot = len(slot_owner)
    group = group_factory(slot_owner + [comm.size - 1], shared=1)
    x, topk, w = batch(4, MAX_TOKENS)
    check_round(group, x, topk, w, log2phy, shared_slots=(shared_slot,))


@pytest.mark.mpi(min_size=2)
def test_int8_rows_stay_within_half_a_scale_step(group_factory):
    slot_owner, log2phy = plain_placement()
    group = group_factory(slot_owner, use_int8=True)
    x, topk, w = batch(5, MAX_TOKENS)
    x[:, :2] = 0  # keep the rows' scale set by the noise
    recv_x, info = check_round(group, x, topk, w, log2phy)
    exact = dispatch_reference(
        *zip(*[(xi, ti) for xi, ti in comm.allgather((x, topk))]), log2phy, (), slot_owner, MEMBERS
    )[comm.rank]["x"]
    scale = np.abs(exact).max(axis=1, keepdims=True) / 127
    assert (np.abs(recv_x - exact) <= scale / 2 * (1 + 1e-6)).all()


@pytest.mark.mpi(min_size=2)
def test_identity_experts_return_x_times_the_weight_sum(group_factory):
    slot_owner, log2phy = plain_placement()
    group = group_factory(slot_owner)
    x, topk, w = batch(6, MAX_TOKENS)
    recv_x, _, handle = group.ep.dispatch(x, topk, w, 9, log2phy=log2phy)
    y = group.ep.combine(recv_x, handle)
    assert np.allclose(y, x * w.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_two_hundred_layers_back_to_back_read_nothing_stale(group_factory):
    slot_owner, log2phy = plain_placement()
    group = group_factory(slot_owner)
    rng = np.random.default_rng(comm.rank)
    for layer in range(200):
        num_tokens = int(rng.integers(0, MAX_TOKENS + 1))
        x, topk, w = batch(1000 + layer, num_tokens)
        recv_x, info, handle = group.ep.dispatch(x, topk, w, layer, log2phy=log2phy)
        # Every row says where it came from; a stale row from an earlier layer would not match.
        expected_first = 1000 + layer
        assert np.array_equal(recv_x[:, 0], info.src_rank)
        assert np.array_equal(recv_x[:, 1], info.src_token)
        y = group.ep.combine(recv_x * (layer + 1), handle)
        assert np.allclose(y, x * w.sum(axis=1, keepdims=True) * (layer + 1), rtol=1e-12), (
            f"layer {layer} (seed {expected_first})"
        )


@pytest.mark.mpi(min_size=2)
def test_a_batch_over_the_maximum_is_refused_before_anything_is_sent(group_factory):
    slot_owner, log2phy = plain_placement()
    group = group_factory(slot_owner)
    x, topk, w = batch(7, MAX_TOKENS + 1)
    with pytest.raises(
        BufferTooSmall,
        match=rf"die rank {comm.rank}: dispatch of "
        rf"{MAX_TOKENS + 1} tokens > max_tokens_per_die",
    ):
        group.ep.dispatch(x, topk, w, 1, log2phy=log2phy)
    x, topk, w = batch(7, MAX_TOKENS)  # nothing was sent: the next dispatch works
    check_round(group, x, topk, w, log2phy, event=2)


@pytest.mark.mpi(min_size=2)
def test_a_stale_event_or_handle_is_named(group_factory):
    slot_owner, log2phy = plain_placement()
    group = group_factory(slot_owner)
    x, topk, w = batch(8, 4)
    event = 5 if comm.rank == 0 else 6
    if comm.rank == 0:
        with pytest.raises(
            EventMismatch,
            match=r"die rank 0: dispatch expected event 5, rank 1 "
            r"reported event 6",
        ):
            group.ep.dispatch(x, topk, w, event, log2phy=log2phy)
    else:
        with pytest.raises(
            EventMismatch,
            match=rf"die rank {comm.rank}: dispatch expected event"
            r" 6, rank 0 reported event 5",
        ):
            group.ep.dispatch(x, topk, w, event, log2phy=log2phy)
    fresh = group_factory(slot_owner).ep
    recv_x, _, first = fresh.dispatch(x, topk, w, 1, log2phy=log2phy)
    fresh.combine(recv_x, first)
    recv_x, _, second = fresh.dispatch(x, topk, w, 2, log2phy=log2phy)
    with pytest.raises(
        XcclError, match="combine with the handle of dispatch 1 .event 1.; the last dispatch was 2"
    ):
        fresh.combine(recv_x, first)
    with pytest.raises(XcclError, match="a handle of another buffer"):
        group.ep.combine(recv_x, second)
    fresh.combine(recv_x, second)
