"""What token recomputation puts back, without MPI: the virtual clock and the pricer round-trip
through snapshot / restore, the executor's checkpoint drops a failed attempt's MTP state and
event ids, and one iteration's attempts restore every part of the die and tell the fault plan
which attempt runs; after a failed vote the clock stays at the failed attempt's end plus the
rollback's price. And the executors' one timing construct, the Meter."""

from __future__ import annotations

import pytest

from ranks.recovery.recompute import IterationAttempts
from xccl.vclock import VirtualClock
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import FaultsConfig, ModelConfig
from xds_mpi.execution import pricing
from xds_mpi.execution.executor import ColocatedExecutor
from xds_mpi.execution.faults import FaultPlan, LayerEvents
from xds_mpi.execution.pricing import Pricer
from xds_mpi.model.shapes import cost_shape
from xds_mpi.model.weights import build_model
from xds_mpi.plan.failures.rollback_cost import RollbackCost
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.scheduling.scheduler import Entry


def pricer() -> Pricer:
    cost = CostModel(cost_shape(), Hardware.from_profile(load_profile("ascend910c")))
    return Pricer(cost, ModelConfig(), VirtualClock(), num_routed_dies=4, use_int8=True)


def price_some_work(p: Pricer) -> None:
    """Attention, gate, a dispatch that waits for a later arrival, experts, combine."""
    p.attention([Entry(req_id=1, start_pos=10, input_ids=(3, 4), is_sampled=True)], is_moe=True)
    p.gate(2)
    with p.waiting("dispatch"):
        p.clock.arrive(p.clock.now_ns + 2500.0)  # the slowest peer's record lands
    p.dispatch(6)
    p.experts(6, 2)
    p.combine(2)


def test_after_vertical_scaling_ep_is_priced_over_the_dies_left():
    from harness import REPO_ROOT

    from ranks.recovery.scale_down import num_routed_dies_left
    from xds_mpi.config.schema import load_config
    from xds_mpi.plan.topology import Topology

    topo = Topology.from_config(load_config(REPO_ROOT / "configs" / "colocated.yaml"))
    assert num_routed_dies_left(topo, ()) == 4 and num_routed_dies_left(topo, (2,)) == 3
    scaled, before, fresh = pricer(), pricer(), pricer()
    scaled.rescale(3)
    fresh.__init__(fresh.cost, ModelConfig(), VirtualClock(), num_routed_dies=3, use_int8=True)
    for p in (scaled, before, fresh):
        price_some_work(p)
    assert dict(scaled.spent) == dict(fresh.spent)  # as if built for 3 dies
    for op in ("dispatch", "experts", "combine"):  # fewer peers, more experts per die
        assert scaled.spent[op] != before.spent[op], op
    assert scaled.spent["attention"] == before.spent["attention"]


def test_the_clock_goes_back_only_by_restore():
    clock = VirtualClock(100.0)
    start = clock.snapshot()
    clock.advance(40.0)
    clock.arrive(1000.0)
    assert clock.now_ns == 1000.0
    clock.restore(start)
    assert clock.now_ns == 100.0
    with pytest.raises(ValueError, match="advance by -1 ns"):
        clock.advance(-1)


def test_the_pricer_round_trips_and_counts_waits_under_their_operation():
    p = pricer()
    price_some_work(p)
    first = p.snapshot()
    assert first["dispatch"] >= 2500e-9  # the wait, then the priced transfer
    start_ns = p.clock.snapshot()
    price_some_work(p)  # a failed attempt's work ...
    p.clock.restore(start_ns)
    p.restore(first)  # ... forgotten
    assert p.snapshot() == first
    price_some_work(p)  # the re-execution prices alike
    again = p.snapshot()
    assert again.keys() == first.keys()
    assert again == pytest.approx({op: 2 * s for op, s in first.items()})


def test_a_wait_that_raised_is_not_counted():
    p = pricer()
    with pytest.raises(RuntimeError), p.waiting("combine"):
        p.clock.arrive(5000.0)
        raise RuntimeError("injected")
    assert p.snapshot() == {}


def test_the_executor_checkpoint_puts_back_event_ids_and_drops_staged_mtp_state():
    model = build_model(ModelConfig())
    ex = ColocatedExecutor(
        model,
        None,
        phy2log=(),
        log2phy=(),
        table=None,
        cache=None,
        pricer=pricer(),
        slots=None,
        mtp_depth=1,
    )
    assert ex.events == LayerEvents(events_per_iteration=len(model.layers) + 1)
    ex.num_iterations = 5
    saved = ex.checkpoint()
    ex.num_iterations += 1
    ex.mtp.staged = {7: "a failed attempt's drafts"}
    ex.restore(saved)
    assert ex.num_iterations == 5 and ex.mtp.staged == {}


class Part:
    """A Recoverable holding one number."""

    def __init__(self, value: int) -> None:
        self.value = value

    def checkpoint(self) -> int:
        return self.value

    def restore(self, checkpoint: int) -> None:
        self.value = checkpoint


def test_iteration_attempts_restore_the_die_and_tell_the_plan_the_attempt():
    p, parts = pricer(), (Part(1), Part(2))
    plan = FaultPlan(FaultsConfig(rate=0.5), 0, LayerEvents(events_per_iteration=4))
    price_some_work(p)
    before, before_ns = p.snapshot(), p.clock.snapshot()

    def body() -> str:
        price_some_work(p)
        for part in parts:
            part.value += 10
        return f"iteration {plan.iteration} attempt {plan.attempt}"

    attempts = IterationAttempts(6, plan=plan, pricer=p, state=parts)
    attempts.begin(0)
    assert body() == "iteration 6 attempt 0"
    assert attempts.vtime_s() == pytest.approx((p.clock.now_ns - before_ns) / 1e9)
    attempts.restore()
    assert [part.value for part in parts] == [1, 2]
    assert p.snapshot() == before and p.clock.now_ns == before_ns
    attempts.begin(1)
    assert body() == "iteration 6 attempt 1" and attempts.attempt == 1


def test_the_meter_sums_wall_time_by_kind_and_keeps_the_total_and_virtual_time(monkeypatch):
    ticks = iter(range(100))  # perf_counter: 0, 1, 2, ... seconds
    monkeypatch.setattr(pricing.time, "perf_counter", lambda: float(next(ticks)))
    clock = VirtualClock(500.0)
    meter = pricing.Meter(clock)  # started at 0
    with meter("attention"):  # 1 .. 2
        clock.advance(2e9)
    with meter("xccl"):  # 3 .. 4
        pass
    with pytest.raises(KeyError), meter("xccl"):  # 5 .. 6: counted, then re-raised
        raise KeyError("x")
    assert dict(meter.seconds) == {"attention": 1.0, "xccl": 2.0}
    assert meter.seconds["experts"] == 0.0  # a kind never entered
    assert meter.total_s() == 7.0
    assert meter.vtime_s() == 2.0


def test_a_failed_vote_keeps_the_failed_attempt_s_time_on_the_clock():
    p, parts = pricer(), (Part(1),)
    plan = FaultPlan(FaultsConfig(rate=0.5), 0, LayerEvents(events_per_iteration=4))
    before = p.snapshot()
    attempts = IterationAttempts(2, plan=plan, pricer=p, state=parts)
    attempts.begin(0)
    price_some_work(p)
    parts[0].value += 10
    failed_ns = p.clock.now_ns
    attempts.restore(resume_ns=failed_ns + 7.0)  # the latest die's detection, and the price
    assert parts[0].value == 1 and p.snapshot() == before  # the state and the priced work back
    assert p.clock.now_ns == failed_ns + 7.0  # the time itself stays spent


def test_the_rollback_s_price_is_the_abort_word_and_the_vote():
    hw = Hardware.from_profile(load_profile("ascend910c"))
    cost = RollbackCost.of(write_latency_s=hw.write_latency_s, read_latency_s=hw.read_latency_s)
    assert cost.notify_s == hw.write_latency_s
    assert cost.total_s == pytest.approx(2 * hw.write_latency_s + hw.read_latency_s)
    assert 0 < cost.total_s < 1e-4  # microseconds: the attempt, not the rollback, is the cost
