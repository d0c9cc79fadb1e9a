"""The parts of vertical scaling that need no MPI job: ring replicas keep every expert when any one
die goes, the balancer gives back a lost group's requests, a lost request resumes where it
stopped, a colocated die's rebuild lines up the survivors' iteration counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mpi4py import MPI

from ranks.colocated.die import ColocatedDie
from ranks.recovery import scale_down
from ranks.recovery.records import tokens_per_s
from ranks.recovery.scale_down import resumed
from xds_mpi.config.schema import config_from_dict
from xds_mpi.eplb.placement import from_topology, remove_die
from xds_mpi.eplb.ring import ring_placement
from xds_mpi.plan.topology import Topology
from xds_mpi.results.results import RequestRecord
from xds_mpi.scheduling.balancer import DecodeBalancer
from xds_mpi.workload.requests import Request


@pytest.mark.parametrize("num_dies, redundant", [(4, 4), (8, 2)])
def test_ring_replicas_survive_the_loss_of_any_one_die(num_dies, redundant):
    cfg = config_from_dict(
        {
            "deployment": {
                "dp_groups_per_domain": num_dies,
                "redundant_slots_per_die": redundant,
            },
            "model": {"num_routed_experts": 16},
        }
    )
    topo = Topology.from_config(cfg)
    ring = ring_placement(topo, 3)
    # Die i's redundant slots hold die i+1's routed experts, in order.
    per_die = 16 // num_dies
    for die in range(num_dies):
        nxt = (die + 1) % num_dies
        held = [ring.phy2log[0][s] for s in ring.redundant_slots(die)]
        assert held == list(range(nxt * per_die, (nxt + 1) * per_die))
    for die in range(num_dies):
        left = remove_die(ring, die)
        assert all(left.log2phy(layer)[e] for layer in range(3) for e in range(16))
    with pytest.raises(ValueError, match="leaves no replica"):
        remove_die(from_topology(topo, 3), 0)


def test_a_lost_group_gives_back_its_requests_and_takes_no_more():
    balancer = DecodeBalancer(
        (1, 2), max_batch=8, kv_capacity_tokens=4096, block_tokens=16, mtp_depth=0
    )
    reqs = [Request(req_id=i, prompt=(1, 2, 3), max_new_tokens=4) for i in range(4)]
    for req in reqs:
        balancer.on_dispatch(balancer.pick(req), req)
    on_two = sorted(r.req_id for r in reqs if balancer._where[r.req_id][0] == 2)
    assert balancer.remove_group(2) == tuple(on_two) and on_two
    assert balancer.pick(reqs[0]) == 1 and balancer.groups == (1,)


def test_a_lost_request_resumes_with_its_tokens_as_prompt():
    record = RequestRecord(req=Request(req_id=7, prompt=(5, 6), max_new_tokens=5, arrival_s=1.0))
    record.add_token(9, 10.0)
    record.add_token(8, 10.5)
    again = resumed(record)
    assert (again.req_id, again.prompt, again.max_new_tokens, again.arrival_s) == (
        7,
        (5, 6, 9, 8),
        3,
        1.0,
    )
    assert tokens_per_s({7: record}, 10.0, 12.0) == 1.0
    assert tokens_per_s({7: record}, 10.2, 12.2) == 0.5


class _Health:
    """What a dead row uses of the die's heartbeats (ranks/core/decode_die.py DieWatch)."""

    def __init__(self) -> None:
        self.is_silent, self.notes = False, []

    def fall_silent(self) -> None:
        self.is_silent = True

    def tell(self, note) -> None:
        self.notes.append(note)


class _Clock:
    now_ns = 0.0


def _dead(row: dict):
    from ranks.faults.dead import DeadDie

    cfg = config_from_dict({"faults": {"events": [{"kind": "dead", "die": 2, **row}]}})
    health, clock = _Health(), _Clock()
    return DeadDie(cfg.faults.events[0], 2, health, clock), health, clock


def test_an_at_s_dead_row_falls_silent_at_the_first_start_at_or_after_it():
    dead, health, clock = _dead({"at_s": 0.3})
    assert dead.after(50) is dead  # no iteration count strikes it
    for start_s in (0.0, 0.1517, 0.2965, 0.29999999):
        assert not dead.at_start(start_s, 3) and not health.is_silent
    clock.now_ns = 0.4403e9  # the die's clock at the agreed start
    assert dead.at_start(0.4403, 3) and health.is_silent
    [note] = health.notes
    assert (note.iteration, note.virtual_s) == (3, 0.4403)
    dead, health, _ = _dead({"at_s": 0.3})
    assert dead.at_start(0.3, 0)  # at it, not only after


def test_an_iteration_dead_row_is_not_struck_by_a_virtual_start():
    dead, health, _ = _dead({"iteration": 5})
    assert not dead.at_start(1e9, 4) and dead.after(4) is dead and not health.is_silent
    assert dead.after(5) is None and health.is_silent


class _Survivors:
    """The survivors' communicator as one die sees it: an allreduce over the dies' counts."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def allreduce(self, value, op):
        assert op is MPI.MAX and value in self.counts
        return max(self.counts)


class _Executor:
    """What rebuild touches of the colocated executor; its iteration count moves only through
    restore, as ColocatedExecutor's does."""

    def __init__(self, num_iterations: int) -> None:
        self.num_iterations = num_iterations
        self.ep = SimpleNamespace(rebuilt=lambda dies: "rebuilt buffer", mem=None)
        self.expert_map = SimpleNamespace(placement=None, install=lambda placement: None)

    def use_buffer(self, ep) -> None:
        self.ep = SimpleNamespace(buffer=ep)

    def restore(self, checkpoint: int) -> None:
        self.num_iterations = checkpoint


@pytest.mark.parametrize("mine, others", [(6, [7, 7]), (7, [6, 7]), (7, [7, 7])])
def test_colocated_survivors_rebuild_on_the_highest_iteration_count(monkeypatch, mine, others):
    """Across hosts the fence's word can overtake the last combine's records: the fence undoes
    iteration 6 on some survivors while others completed it (count 7). After the rebuild every
    survivor numbers the next iteration's events from the same count (the afd dies' rule)."""
    survivors = _Survivors([mine, *others])
    monkeypatch.setattr(scale_down, "survivors", lambda dies, world, lost: survivors)
    monkeypatch.setattr(scale_down, "num_routed_dies_left", lambda topo, lost: 3)
    monkeypatch.setattr(scale_down, "without_dies", lambda placement, topo, lost: placement)
    monkeypatch.setattr(scale_down, "send_ready", lambda *args: None)
    die = ColocatedDie.__new__(ColocatedDie)  # its parts, no MPI job
    die.executor = _Executor(mine)
    die.recompute = SimpleNamespace(restore_interrupted=lambda: None, regroup=lambda d, b: None)
    die.retired, die.dies, die.world, die.topo = [], None, None, None
    die.pricer = SimpleNamespace(rescale=lambda n: None)
    die.health = SimpleNamespace(shell=0)
    die.outbox = SimpleNamespace(num_batches=0)
    die.vtime = None  # the wall clock: no failover to price
    die.rebuild(scale_down.Failover(lost=(4,)))
    assert die.executor.num_iterations == max(mine, *others) == 7
    assert die.dies is survivors and die.is_scaled
