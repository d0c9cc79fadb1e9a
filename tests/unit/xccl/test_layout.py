"""The p2p layout: offsets in one place, disjoint and inside the window; size hints; the cap."""

from __future__ import annotations

import numpy as np
import pytest
from harness import REPO_ROOT

from xccl.errors import OutOfWindow, UnknownPeer
from xccl.layout import RECORD_BYTES, P2PLayout, all_pairs
from xccl.quant import decode_rows, encode_rows, quant_dequant, send_row_bytes
from xccl.vclock import LinkModel, VirtualClock


def regions(layout: P2PLayout, rank: int) -> list[tuple[int, int, str]]:
    out = []
    for src, dst in layout.pairs:
        if dst == rank:
            out.append((layout.record_offset(src, dst), 2 * RECORD_BYTES, f"records {src}"))
            out.append((layout.ring_offset(src, dst), layout.ring_bytes, f"ring {src}"))
        if src == rank:
            out.append((layout.ack_offset(src, dst), RECORD_BYTES, f"ack {dst}"))
    return sorted(out)


@pytest.mark.parametrize("pairs", [all_pairs(range(5)), {(0, 1), (2, 1), (1, 1), (3, 0)}])
def test_regions_are_disjoint_and_fill_the_window(pairs):
    layout = P2PLayout.build(5, 4, 64, pairs)
    for rank in range(5):
        ins = sum(1 for s, d in pairs if d == rank)
        outs = sum(1 for s, d in pairs if s == rank)
        assert layout.window_bytes(rank) == RECORD_BYTES * (2 * ins + outs) + ins * 4 * 64
        end = 0
        for offset, size, name in regions(layout, rank):
            assert offset == end, f"rank {rank}: {name} at {offset}, expected {end}"
            end = offset + size
        assert end == layout.window_bytes(rank)


def test_an_undeclared_pair_has_no_ring():
    layout = P2PLayout.build(3, 4, 64, {(0, 1)})
    with pytest.raises(UnknownPeer, match="no p2p ring for rank 1 -> rank 0"):
        layout.ring_offset(1, 0)
    with pytest.raises(UnknownPeer, match="outside ranks 0..2"):
        P2PLayout.build(3, 4, 64, {(0, 3)})


def test_the_cap_refuses_with_the_formula():
    layout = P2PLayout.build(769, 8, 65536, all_pairs(range(1, 769)))
    assert layout.window_bytes(0) == 0
    assert layout.window_bytes(1) == RECORD_BYTES * 3 * 768 + 768 * 8 * 65536
    with pytest.raises(OutOfWindow) as err:
        layout.check_cap(1 << 28)
    assert str(err.value) == (
        "rank 1's window needs 402800640 B = 64 x (2 x 768 in + 768 out) records + 768 rings x 8 "
        "slots x 65536 B, over the per-die cap xccl.max_window_bytes(268435456)"
    )


@pytest.mark.parametrize(
    "first, nbytes, runs",
    [
        (0, 0, []),
        (0, 10, [(0, 0, 10)]),
        (3, 64, [(192, 0, 64)]),
        (3, 100, [(192, 0, 64), (0, 64, 36)]),
        (6, 256, [(128, 0, 128), (0, 128, 128)]),
    ],
)
def test_slot_runs_wrap_around_the_ring(first, nbytes, runs):
    assert P2PLayout.build(2, 4, 64, {(0, 1)}).slot_runs(first, nbytes) == runs


def test_link_model_costs_follow_the_profile_numbers():
    link = LinkModel(
        write_gb_per_s_intra=137,
        write_gb_per_s_inter=135,
        write_latency_us_intra=1.3,
        write_latency_us_inter=2.1,
        mte_gb_per_s_per_core=27,
        dma_startup_us=10,
        max_cores=48,
    )
    assert link.transfer_ns(0) == pytest.approx(2100)
    assert link.transfer_ns(27_000, num_cores=1) == pytest.approx(2100 + 1000)
    assert link.transfer_ns(54_000, num_cores=2, same_server=True) == pytest.approx(1300 + 1000)
    assert link.transfer_ns(135_000, num_cores=48) == pytest.approx(2100 + 1000)  # link-capped
    assert link.transfer_ns(135_000, path="dma") == pytest.approx(2100 + 10_000 + 1000)


def test_a_clock_only_moves_forward():
    clock = VirtualClock(100.0)
    assert clock.arrive(50.0) == 100.0 and clock.arrive(150.0) == 150.0
    assert clock.advance(10) == 160.0
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_ep_area_follows_its_formula():
    from xccl.moe_layout import EpLayout

    ep = EpLayout(
        members=(1, 2, 3),
        base=(0, 100 * 64, 0, 64),
        hidden=10,
        max_tokens=4,
        num_columns=3,
        itemsize=8,
        use_int8=True,
    )
    assert ep.send_row_bytes == 16 and ep.out_row_bytes == 80  # 10 + 4 -> 16; 10 x 8
    assert ep.max_send_rows == 12 and ep.max_recv_rows == 36
    # records, records, staging, index, combine rows, agreement (2 banks x 3 slots x 7 words)
    sizes = [3 * 64, 3 * 64, 12 * 16, 12 * 16, 36 * 80, 2 * 3 * 7 * 8]  # each rounded up to 64 B
    assert ep.area_bytes() == sum((s + 63) // 64 * 64 for s in sizes)
    assert ep.offset(1, "dispatch_records") == 6400
    assert ep.record_offset(3, "combine", 2) == 64 + 3 * 64 + 2 * 64


def test_a_die_receives_at_most_one_row_per_token_for_each_slot_it_hosts():
    from dataclasses import replace

    from xccl.moe_layout import EpLayout

    ep = EpLayout(
        members=tuple(range(1, 289)),
        base=(0,) * 289,
        hidden=128,
        max_tokens=60,
        num_columns=9,  # top-8 + a dedicated shared expert
        itemsize=8,
        use_int8=False,
        max_slots_per_die=2,  # ep288: one routed + one redundant slot per die
    )
    assert ep.max_recv_rows == 288 * 60 * 2
    assert replace(ep, max_slots_per_die=16).max_recv_rows == 288 * 60 * 9  # capped by columns
    assert replace(ep, max_slots_per_die=0).max_recv_rows == 288 * 60 * 9  # unknown: columns


def test_ep288_windows_are_sized_from_what_a_die_can_receive():
    from xds_mpi.config.schema import load_config
    from xds_mpi.plan.deployment import DeploymentPlan

    plan = DeploymentPlan.build(load_config(str(REPO_ROOT / "configs" / "ep288.yaml")), 289)
    assert plan.ep.max_slots_per_die == 2
    assert max(plan.window_bytes) < 40 * 2**20  # 162 MiB when every row could go to one slot


def test_afd_agreement_area_follows_the_lanes_and_skips_a_lost_die():
    from xccl.moe_layout import AGREE_WORDS, AfdLayout

    def layout(attention):
        return AfdLayout(
            attention=attention,
            experts=(4, 5),
            group_size=2,
            base=(0, 0, 0, 128, 0, 64),
            num_lanes=3,
            hidden=8,
            max_tokens=4,
            top_k=2,
            has_shared=True,
            itemsize=8,
            use_int8=False,
        )

    whole, lost = layout((0, 1, 2, 3)), layout((0, -1, 2, 3))
    assert whole.members == (0, 1, 2, 3, 4, 5) and lost.members == (0, 2, 3, 4, 5)
    for afd in (whole, lost):
        for rank in afd.members:
            role = afd.role_of(rank)
            lanes_end = afd.offset(rank, "back_records", afd.num_lanes - 1)
            lanes_end += afd._areas[role]["lane"] - afd._areas[role]["back_records"]
            at = afd.offset(rank, "agreement")
            slot_bytes = (AGREE_WORDS + 1) * 8
            assert at == lanes_end  # after every lane, none overlapped
            assert at + 2 * len(afd.members) * slot_bytes <= afd.base[rank] + afd.area_bytes(role)
    # 2 banks x 6 vs 5 slots x 56 B: 672 vs 560 B, each rounded up to 64 B
    assert whole.area_bytes("attention") - lost.area_bytes("attention") == 704 - 576


@pytest.mark.parametrize(
    "hidden, dtype, use_int8",
    [(5, np.float32, False), (6, np.float64, False), (5, np.float32, True), (7, np.float64, True)],
)
def test_wire_rows_round_trip_with_and_without_padding(hidden, dtype, use_int8):
    # float32 x 5 = 20 B rows padded to 24: the values must come back, not the padding.
    x = np.random.default_rng(hidden).standard_normal((4, hidden)).astype(dtype)
    token = np.array([2, 0, 3])
    staged = np.full(
        (3, send_row_bytes(hidden, np.dtype(dtype).itemsize, use_int8)), 0xA5, np.uint8
    )
    encode_rows(staged, x, token, hidden=hidden, use_int8=use_int8, dtype=dtype)
    back = decode_rows(staged, hidden=hidden, use_int8=use_int8, dtype=dtype)
    expected = quant_dequant(x[token]) if use_int8 else x[token]
    assert back.shape == (3, hidden) and np.array_equal(back, expected)
