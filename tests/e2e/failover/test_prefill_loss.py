"""A prefill die lost in a PD run (xDeepServe §6.1-6.2): the JE's heartbeat finds its TE's
leader silent, takes the TE out and has its requests prefilled again on the live TE; no hang,
no request lost, and every request checks equal to the reference.

Two prefill TEs of one die each (6 and 7; long prompts on 7, short on 6) feed 4 decode dies.
The heartbeat timeout is generous (the machine is shared): a prefill iteration under load stays
well below it.
"""

from __future__ import annotations

import pytest
from test_serving_pd import explain, serve

from xds_mpi.config.schema import ConfigError, config_from_dict
from xds_mpi.plan.failures.checks import check_failures
from xds_mpi.plan.topology import Topology
from xds_mpi.results.failures import read_failures

SETS = (
    "pd.num_prefill_tes=2",
    "health.control_interval_s=0.5",
    "health.timeout_s=4",
    "workload.num_requests=12",
)


@pytest.mark.parametrize(
    "row",
    [
        "{kind: dead, die: 6, iteration: 0}",  # before its first prefill batch
        pytest.param(  # mid-run, after two batches
            "{kind: stuck, die: 7, iteration: 2}", marks=pytest.mark.failure_cell("pd", "stuck")
        ),
    ],
)
def test_a_lost_prefill_die_loses_no_request(tmp_path, row):
    result, run_file = serve(tmp_path, *SETS, f"faults.events=[{row}]")
    assert result.returncode == 0, explain(result)
    assert "check: 12 requests" in result.stdout and " 0 mismatches" in result.stdout
    (record,) = read_failures(run_file)
    assert (record.detected_by, record.verdict, record.role) == ("heartbeat", "silent", "prefill")
    assert 3 <= record.detection_s < 30, record  # health.timeout_s (4) after the last answer
    assert record.detected_virtual_s > record.injected_virtual_s >= 0
    assert record.requests_lost == () and "prefill instance lost" in record.recovery
    assert list(run_file["requests"]["num_tokens"][()]).count(0) == 0, explain(result)


@pytest.mark.parametrize(
    "sets, reason",
    [
        ({"num_prefill_tes": 1, "dies": 1}, r"another prefill TE \(pd.num_prefill_tes 1\)"),
        ({"num_prefill_tes": 1, "dies": 2}, r"one die per prefill TE \(deployment"),
    ],
)
def test_prefill_losses_that_would_hang_or_lose_work_are_refused(sets, reason):
    deployment = {"num_prefill_dies": sets["dies"], "num_host_ranks": 2}
    cfg = config_from_dict(
        {
            "pd": {"enabled": True, "num_prefill_tes": sets["num_prefill_tes"]},
            "deployment": deployment,
            "faults": {"events": [{"kind": "dead", "die": 6, "iteration": 0}]},
        }
    )
    with pytest.raises(ConfigError, match=reason):
        check_failures(cfg, Topology.from_config(cfg))
