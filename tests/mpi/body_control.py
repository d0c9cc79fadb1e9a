"""Control plane and startup handshake at any rank count (run by
tests/e2e/bodies/test_mpi_bodies.py)."""

from __future__ import annotations

import logging
import time

import pytest
from mpi4py import MPI

from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, recv_from_each, send_to_each, wait_all
from ranks.core.handshake import handshake
from xccl.gmem_paths import node_leader
from xds_mpi.config.schema import config_from_dict
from xds_mpi.plan.deployment import DeploymentPlan

comm = MPI.COMM_WORLD


def context(overrides=()) -> RankContext:
    """A colocated deployment of 1 TE-shell + (size-1) dies, for whatever size this job has."""
    num_dies = comm.size - 1
    cfg = config_from_dict(
        {
            "deployment": {"dp_groups_per_domain": num_dies},
            "model": {"num_routed_experts": 8 * num_dies},
            "xccl": {"poll_timeout_s": 20},
        },
        overrides,
    )
    return RankContext(
        plan=DeploymentPlan.build(cfg, comm.size),
        comm=comm,
        log=logging.getLogger("test"),
        node_leader=node_leader(comm),
    )


@pytest.mark.mpi(min_size=2)
def test_every_rank_derives_the_same_topology():
    topo = context().topo
    everyone = comm.allgather(topo)
    assert all(t == everyone[0] for t in everyone)
    info = topo.ranks[comm.rank]
    assert info.rank == comm.rank
    assert info.role == ("host" if comm.rank == 0 else "colocated")


@pytest.mark.mpi(min_size=2)
def test_handshake_passes_when_ranks_agree():
    handshake(context())


@pytest.mark.mpi(min_size=2)
def test_handshake_refuses_a_rank_with_another_config():
    # The last rank reads a different file (here: one changed value); every rank must stop.
    odd = ["scheduler.max_batch_per_die=3"] if comm.rank == comm.size - 1 else []
    expected = "disagree" if comm.rank == 0 else "refused"
    with pytest.raises(RuntimeError, match=expected) as err:
        handshake(context(odd))
    if comm.rank == 0:
        assert f"rank {comm.size - 1} loaded config" in str(err.value)


@pytest.mark.mpi(min_size=2)
def test_control_messages_arrive_from_every_peer():
    peers = [r for r in range(comm.size) if r != comm.rank]
    payload = {p: ("from", comm.rank, "to", p, bytes(70_000)) for p in peers}  # > eager size
    send_requests = [comm.isend(payload[p], dest=p, tag=7) for p in peers]
    received = recv_from_each(
        comm, peers, tag=7, timeout_s=20, me=f"rank {comm.rank}", event="test message"
    )
    wait_all(send_requests, timeout_s=20, me=f"rank {comm.rank}", event="test message")
    assert {p: m[:4] for p, m in received.items()} == {
        p: ("from", p, "to", comm.rank) for p in peers
    }


@pytest.mark.mpi(min_size=2)
def test_a_missing_message_ends_in_a_named_timeout():
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match=rf"rank {comm.rank}: no never-sent event from rank\(s\)"):
        recv_from_each(
            comm,
            [(comm.rank + 1) % comm.size],
            tag=99,
            timeout_s=0.3,
            me=f"rank {comm.rank}",
            event="never-sent event",
        )
    assert time.monotonic() - started < 5
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_an_unreceived_send_ends_in_a_named_timeout():
    if comm.rank == 0:
        with pytest.raises(WaitTimeout, match=r"orphan not taken by rank\(s\) \[1\]"):
            send_to_each(comm, {1: "x"}, tag=98, timeout_s=0.3, me="rank 0", event="orphan")
    comm.Barrier()
    if comm.rank == 1:  # drain it so the next test starts clean
        assert comm.recv(source=0, tag=98) == "x"


@pytest.mark.mpi(min_size=2)
def test_sends_a_peer_never_takes_end_in_a_timeout_naming_it():
    """Rank 0 sends each peer more than the eager size (so a send completes only once taken);
    the last rank takes its message only after rank 0's wait gave up."""
    late = comm.size - 1
    if comm.rank == 0:
        peers = list(range(1, comm.size))
        sends = [comm.isend(("from", 0, "to", p, bytes(70_000)), dest=p, tag=97) for p in peers]
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as raised:
            wait_all(sends[:-1], timeout_s=20, me="rank 0", event="early", peers=peers[:-1])
            wait_all(sends, timeout_s=0.5, me="rank 0", event="big message", peers=peers)
        assert str(raised.value) == (
            f"rank 0: big message: 1 of {len(peers)} not complete after 0.5 s (rank(s) [{late}])"
        )
        assert time.monotonic() - started < 20
        comm.Barrier()
        wait_all(sends, timeout_s=20, me="rank 0", event="big message", peers=peers)
    else:
        if comm.rank != late:
            assert comm.recv(source=0, tag=97)[:4] == ("from", 0, "to", comm.rank)
        comm.Barrier()
        if comm.rank == late:
            assert comm.recv(source=0, tag=97)[:4] == ("from", 0, "to", late)


@pytest.mark.mpi(min_size=2)
def test_heartbeats_name_the_rank_whose_loop_stopped():
    from ranks.recovery.watch import HeartbeatResponder, HeartbeatSender

    quiet = comm.size - 1  # this rank's loop "stalls" after three answers
    done = bytearray(1)
    if comm.rank == 0:
        sender = HeartbeatSender(comm, range(1, comm.size), interval_s=0.02, timeout_s=2.0)
        deadline = time.monotonic() + 20
        while not sender.silent() and time.monotonic() < deadline:
            sender.tick()
            time.sleep(0.005)
        suspects = sender.silent()
        comm.Ibcast(done, root=0).Wait()  # everyone may stop answering now
        # No collective after: every responder's answers are taken up to its last one.
        sender.close(timeout_s=20, last_from=range(1, comm.size))
        assert suspects == [quiet]
        assert all(sender.status[t] == ("alive", t) for t in range(1, comm.size))
    else:
        responder = HeartbeatResponder(comm, 0)
        released = comm.Ibcast(done, root=0)
        deadline = time.monotonic() + 25
        while not released.Test():
            assert time.monotonic() < deadline, f"rank {comm.rank}: never released by rank 0"
            if comm.rank != quiet or responder.answered < 3:
                responder.answer(("alive", comm.rank))
            time.sleep(0.005)
        responder.close(timeout_s=20, last=True)
