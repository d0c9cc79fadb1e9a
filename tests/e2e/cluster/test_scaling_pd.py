"""A standby PD pair (docs/scaling.md, "Weights at scale-out"): 1 serving + 1 standby pair, each
its JE, its decode TE-shell, 1 prefill die and `decode_dies` decode dies; the burst scales out to
the standby pair, whose prefill and decode dies start on zeroed weights and pull them by its
scaling.path (fork: one-sided reads from the same die of the serving pair; cold: the file).
`--check` then proves the weights the pair served with: every token equals the single-process
reference's, with the premise that the pair was routed requests, all at or after its serves_s.
The bytes moved are the dies' weights, counted from the unpacked file's index: the prefill die
holds every routed expert (one prefill die), the decode dies split them. Each run is bounded by
the subprocess timeout and run.timeout_s."""

from __future__ import annotations

import numpy as np
import pytest
from test_cluster import AUTOSCALE, assert_all_checked, run_cluster
from test_cluster_fork import _burst, _weights_bytes
from test_virtual_time import _sets

PAIR = (
    "pd.enabled=true, deployment.num_host_ranks=2, deployment.num_prefill_dies=1, "
    "deployment.dp_groups_per_domain={dies}, xccl.p2p_pairs=prefill_to_decode, "
    "xccl.ring_slots=8, xccl.slot_bytes=16384"
)


@pytest.mark.parametrize(
    "path, decode_dies", [("fork", 2), ("cold", 1)], ids=["fork-2-decode-dies", "cold"]
)
def test_a_standby_pd_pair_serves_with_the_weights_it_pulled(tmp_path, path, decode_dies):
    lines, workload = _burst(tmp_path)
    pair = PAIR.format(dies=decode_dies)
    groups = (
        f"cluster.groups=[{{count: 1, name: pair, set: [{pair}]}}, "
        f"{{count: 1, name: standby-pair, standby: true, set: [{pair}, scaling.path={path}]}}]"
    )
    result, run_file = run_cluster(
        tmp_path,
        *workload,
        *_sets(
            groups,
            "cluster.policy=least_load",
            *AUTOSCALE,
        ),
    )
    assert_all_checked(result, lines)
    assert [k.decode() for k in run_file["cluster/te_kind"][()]] == ["pd", "pd"]
    scaling = run_file["cluster/scaling"]
    outs = [k.decode() == "out" for k in scaling["kind"][()]]
    assert outs.count(True) == 1, outs  # one scale-out, to TE 1
    (out,) = np.flatnonzero(outs)
    assert scaling["te"][out] == 1
    te, routed_s = run_file["cluster/te"][()], run_file["cluster/routed_s"][()]
    assert (te == 1).sum() >= 3  # the premise: the scaled-out pair served part of the burst
    assert routed_s[te == 1].min() >= scaling["serves_s"][out]  # none before it served
    assert scaling["load_path"][out].decode() == path
    # its prefill die and decode dies: 1 + decode_dies dies' shared tensors, the routed experts
    # twice (all on the prefill die, split among the decode dies)
    routed = _weights_bytes(tmp_path, num_dies=0)
    assert scaling["load_bytes"][out] == _weights_bytes(tmp_path, num_dies=1 + decode_dies) + routed
    assert scaling["load_source_te"][out] == (0 if path == "fork" else -1)
    assert 0 < scaling["load_wall_s"][out] < 60
