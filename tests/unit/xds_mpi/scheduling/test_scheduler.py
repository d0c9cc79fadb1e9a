"""The die scheduler's policy without a model: MTP verify rows and budget, committing accepted
tokens (rejected drafts' KV dropped, max_new_tokens and EOS as the reference), and the checkpoint
a failed iteration is restored to."""

from __future__ import annotations

from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.scheduling.scheduler import DieScheduler, Sampled
from xds_mpi.workload.requests import Request

EOS = 257


def scheduler(
    *, mtp_depth: int, max_tokens: int = 64, chunk: int = 64, ignore_eos: bool = False
) -> DieScheduler:
    return DieScheduler(
        table=BlockTable(num_blocks=32, block_tokens=4),
        max_batch=4,
        max_tokens=max_tokens,
        prefill_chunk=chunk,
        eos_id=EOS,
        ignore_eos=ignore_eos,
        mtp_depth=mtp_depth,
    )


def request(req_id: int, prompt_len: int = 5, max_new: int = 6) -> Request:
    return Request(req_id=req_id, prompt=tuple(range(10, 10 + prompt_len)), max_new_tokens=max_new)


def test_verify_rows_carry_the_drafts_and_rejected_drafts_leave_the_kv():
    s = scheduler(mtp_depth=2)
    s.add(request(0))
    [prefill] = s.schedule()
    assert prefill.is_sampled and prefill.input_ids == tuple(range(10, 15))
    s.postprocess({0: Sampled(tokens=(1,), drafts=(2, 3))})
    [verify] = s.schedule()
    assert (verify.start_pos, verify.input_ids, verify.num_drafts) == (5, (1, 2, 3), 2)
    assert s.table.seq_len(0) == 8  # t_m and both drafts are in the cache
    emitted = s.postprocess({0: Sampled(tokens=(2, 9), drafts=(4, 5))})  # draft 3 rejected
    assert [e.token for e in emitted] == [2, 9]
    assert s.table.seq_len(0) == 7  # prompt + 1, 2 (9 is not in the cache yet)
    assert s.running[0].tokens[-3:] == [1, 2, 9] and s.running[0].drafts == (4, 5)


def test_max_new_tokens_and_eos_cut_the_accepted_tokens():
    s = scheduler(mtp_depth=2)
    s.add(request(0, max_new=3))
    s.add(request(1, max_new=9))
    s.schedule()
    s.postprocess({0: Sampled(tokens=(1,), drafts=(2, 3)), 1: Sampled(tokens=(1,), drafts=(7, 8))})
    s.schedule()
    emitted = s.postprocess({0: Sampled(tokens=(2, 3, 4)), 1: Sampled(tokens=(7, EOS, 6))})
    assert [(e.req_id, e.token, e.is_finished) for e in emitted] == [
        (0, 2, False),
        (0, 3, True),
        (1, 7, False),
        (1, EOS, True),
    ]
    assert not s.running and s.reserved_blocks == 0 and s.table.num_free_blocks == 32


def test_the_budget_keeps_headroom_for_the_deeper_mtp_passes():
    # depth 2: an entry of n rows may need n + 1 rows at MTP depth 2
    s = scheduler(mtp_depth=2, max_tokens=10, chunk=64)
    s.add(request(0, prompt_len=30))
    [chunk] = s.schedule()
    assert len(chunk.input_ids) == 9  # 10 - 1 row of headroom
    s2 = scheduler(mtp_depth=0, max_tokens=10)
    s2.add(request(0, prompt_len=30))
    assert len(s2.schedule()[0].input_ids) == 10


def test_restore_undoes_schedule():
    s = scheduler(mtp_depth=1, chunk=3)
    s.add(request(0))
    s.schedule()
    s.postprocess({})  # first chunk of 3 of 5 prompt tokens
    s.add(request(1))
    before = (list(s.waiting), s.running[0].num_prefilled, s.reserved_blocks, s.table.snapshot())
    cp = s.checkpoint()
    first = s.schedule()
    assert [e.req_id for e in first] == [0, 1] and 1 in s.running
    s.restore(cp)
    assert (
        list(s.waiting),
        s.running[0].num_prefilled,
        s.reserved_blocks,
        s.table.snapshot(),
    ) == before
    assert 1 not in s.running
    assert s.schedule() == first  # the same batch again


def test_a_prefix_hit_is_written_on_admission_and_again_after_a_rollback():
    """EMS (DieScheduler.prefix_hits): a request whose first 8 tokens were pulled from the pool
    starts its prefill after them, its KV slots written once admitted; a rolled-back iteration
    (restore) undoes the admission and keeps the hit, so the next schedule writes it again."""
    s = scheduler(mtp_depth=0)
    written = []
    s.prefix_hits = {0: (8, written.append)}
    s.add(request(0, prompt_len=10))
    cp = s.checkpoint()
    (entry,) = s.schedule()
    assert (entry.start_pos, len(entry.input_ids)) == (8, 2) and len(written) == 1
    assert list(written[0]) == s.table.slots(0, 0, 8)
    s.restore(cp)
    assert s.prefix_hits and not s.running
    (entry,) = s.schedule()
    assert (entry.start_pos, len(entry.input_ids)) == (8, 2) and len(written) == 2
    assert not s.prefix_hits  # taken by the admission
