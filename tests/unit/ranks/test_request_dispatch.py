"""The TE-shell's request hand-off (ranks/shell/frontend.py `Frontend._dispatch_arrived`): the
requests that have arrived go to their DP groups as one message per die per turn, and a die's
inbox (ranks/core/die_io.py `Inbox`) takes such a message whole. One request per message let a
die start an iteration between two of its requests, and the second then waited a whole
iteration for its prefill (the main job's TTFT p99 was about twice its p50)."""

from __future__ import annotations

import time
from collections import deque

from ranks.core.messages import TAG_REQUEST
from ranks.shell.frontend import Frontend
from xds_mpi.results.results import RequestRecord
from xds_mpi.scheduling.balancer import DecodeBalancer
from xds_mpi.workload.requests import Request


class _Pending:
    """An isend no die has taken yet."""

    def Test(self) -> bool:  # noqa: N802 (MPI's name)
        return False


class _Comm:
    """Records isend calls; the inbox side gives back what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, int, int]] = []

    def isend(self, obj, *, dest: int, tag: int):
        self.sent.append((obj, dest, tag))
        return _Pending()


def _frontend(requests: list[Request], groups: list[int]) -> Frontend:
    frontend = object.__new__(Frontend)  # only what _dispatch_arrived reads
    frontend.comm, frontend.sends, frontend.vclock_of = _Comm(), [], {}
    frontend.records = {r.req_id: RequestRecord(req=r) for r in requests}
    frontend.queue = deque(requests)
    frontend.balancer = DecodeBalancer(
        groups, max_batch=8, kv_capacity_tokens=4096, block_tokens=16, mtp_depth=0
    )
    frontend.started = time.time()
    return frontend


def test_a_burst_of_arrivals_goes_to_each_die_in_one_message():
    requests = [Request(req_id=i, prompt=(1, 2, 3), max_new_tokens=4) for i in range(10)]
    frontend = _frontend(requests, [1, 2, 3, 4])
    assert frontend._dispatch_arrived() == 10
    sent = frontend.comm.sent
    assert sorted(dest for _, dest, _ in sent) == [1, 2, 3, 4]  # one message per die
    assert all(tag == TAG_REQUEST for _, _, tag in sent)
    by_die = {dest: [r.req_id for r in reqs] for reqs, dest, _ in sent}
    assert sorted(i for ids in by_die.values() for i in ids) == list(range(10))
    for die, ids in by_die.items():  # each record names the die its message went to
        assert all(frontend.records[i].die_rank == die for i in ids)
    assert len(frontend.sends) == 4


def test_a_later_arrival_waits_for_its_turn():
    requests = [
        Request(req_id=0, prompt=(1, 2), max_new_tokens=2),
        Request(req_id=1, prompt=(1, 2), max_new_tokens=2, arrival_s=3600.0),
    ]
    frontend = _frontend(requests, [1, 2])
    assert frontend._dispatch_arrived() == 1
    [(reqs, _, _)] = frontend.comm.sent
    assert [r.req_id for r in reqs] == [0]
    assert [r.req_id for r in frontend.queue] == [1]
