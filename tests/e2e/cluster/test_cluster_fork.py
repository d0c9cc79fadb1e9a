"""Weights at scale-out (docs/scaling.md, "Weights at scale-out"): 1 serving + 1 standby
colocated TE (2 dies each, 7 ranks); a burst scales out to the standby TE, whose dies start on
zeroed weights and pull them by its scaling.path (fork: one-sided reads from the serving TE's
dies; dram: its TE-shell's window with the packed model; cold: the file). `--check` then proves
the weights the scaled-out TE served with: every token equals the single-process reference's,
with the premise that it served part of the burst; the bytes moved are the dies' weights, counted
here from the unpacked file's index (every die holds all but the routed experts; each routed
expert lives on one die). Each run is bounded by the subprocess timeout and run.timeout_s."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_cluster import AUTOSCALE, assert_all_checked, run_cluster
from test_virtual_time import _jsonl, _sets

ROUTED = re.compile(r"(^|\.)experts\.\d+\.")  # a routed expert's tensor (not shared_experts)


def _burst(tmp_path) -> tuple[list[dict], list[str]]:
    """1 request/s for 3 s, 32 at 16/s, then 1/s: the burst scales out (its TE serving 0.5 s
    after the decision)."""
    times = [0.0, 1.0, 2.0] + [3 + i / 16 for i in range(32)] + [6.0, 7.0, 8.0]
    lines = [
        {"prompt_ids": list(range(3 + i % 7, 19 + i % 7)), "max_tokens": 12, "arrival_s": t}
        for i, t in enumerate(times)
    ]
    return lines, _jsonl(tmp_path, lines)


def _weights_bytes(tmp_path, num_dies: int) -> int:
    """The TE's weights as its dies hold them, from the launcher's unpacked copy's index."""
    (meta,) = tmp_path.glob(".weights/*/meta.json")
    routed = shared = 0
    for name, (_, dtype, shape) in json.loads(meta.read_text())["tensors"].items():
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if ROUTED.search(name):
            routed += nbytes
        else:
            shared += nbytes
    return num_dies * shared + routed


@pytest.mark.parametrize(
    "path, extra",
    [("fork", ()), ("fork", ("xccl.memory_path=rma",)), ("dram", ()), ("cold", ())],
    ids=["fork", "fork-rma", "dram", "cold"],
)
def test_a_scaled_out_te_serves_with_the_weights_it_pulled(tmp_path, path, extra):
    lines, workload = _burst(tmp_path)
    groups = (
        "cluster.groups=[{count: 1, set: [deployment.dp_groups_per_domain=2]}, "
        "{count: 1, standby: true, set: [deployment.dp_groups_per_domain=2, "
        f"scaling.path={path}]}}]"
    )
    result, run_file = run_cluster(
        tmp_path,
        *workload,
        *_sets(
            groups,
            "cluster.policy=least_load",
            *AUTOSCALE,
            *extra,
        ),
    )
    assert_all_checked(result, lines)
    te = run_file["cluster/te"][()]
    assert (te == 1).sum() >= 3  # the premise: the scaled-out TE served part of the burst
    scaling = run_file["cluster/scaling"]
    outs = [k.decode() == "out" for k in scaling["kind"][()]]
    assert outs.count(True) == 1, outs  # one scale-out, to TE 1
    (out,) = np.flatnonzero(outs)
    assert scaling["te"][out] == 1
    assert scaling["load_path"][out].decode() == path
    assert scaling["load_bytes"][out] == _weights_bytes(tmp_path, num_dies=2)
    assert scaling["load_source_te"][out] == (0 if path == "fork" else -1)
    assert 0 < scaling["load_wall_s"][out] < 60
    # the virtual clock is the priced one: serving from the decision + autoscaler.scale_out_s
    assert scaling["serves_s"][out] == pytest.approx(scaling["decided_s"][out] + 0.5)
