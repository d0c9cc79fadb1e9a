"""The fault-free path stays lean (issue 57): one decode iteration of the main job, default config
(heartbeats on, no fault row), measured inside every die (tests/data/stack_site): the Python stack
from DecodeDieLoop.step() to the deepest line that calls MPI is at most MAX_DEPTH frames deep, and
the only calls that go up a layer are the heartbeats' detection (DieWatch, which core declares and
recovery implements) and step()'s template call into the die's own iterate()."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import REPO_ROOT

SITE = REPO_ROOT / "tests" / "data" / "stack_site"
MAX_DEPTH = 19  # step() ... Win.Sync(): 25 before failure injection left this path
ALLOWED_UP = {
    "ranks/core/decode_die.py:step -> ranks/recovery/watch.py:is_out",
    "ranks/core/decode_die.py:step -> ranks/recovery/watch.py:answer",
    "ranks/core/decode_die.py:step -> ranks/colocated/die.py:iterate",
}


def measure(tmp_path, *sets: str) -> list[dict]:
    out = tmp_path / "stack"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO_ROOT)]),
        "XDS_STACK_OUT": str(out),
        "XDS_STACK_REPO": str(REPO_ROOT),
    }
    sets = ("run.output_dir=" + str(tmp_path), *sets)
    command = [sys.executable, "-m", "launch.cli", "run", "--check"]
    command += [arg for s in sets for arg in ("--set", s)]
    run = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and " 0 mismatches" in run.stdout, (
        run.stdout[-2000:] + run.stderr[-2000:]
    )
    turns = [json.loads(line) for f in tmp_path.glob("stack.*.jsonl") for line in f.open()]
    assert turns, "no die measured its turns"
    return turns


@pytest.mark.parametrize(
    "sets",
    [
        (),
        (  # a dead die: its peers' path is the fault-free one until the fence
            "health.timeout_s=4",
            "deployment.redundant_slots_per_die=4",
            "health.replicas=ring",
            "faults.events=[{kind: dead, die: 2, iteration: 5}]",
        ),
    ],
    ids=["default", "dead_die_row"],
)
def test_the_fault_free_path_is_shallow_and_calls_no_layer_above(tmp_path, sets):
    turns = measure(tmp_path, *sets)
    deepest = max(turns, key=lambda t: t["depth"])
    assert 10 <= deepest["depth"] <= MAX_DEPTH, "\n".join(deepest["chain"])
    up = {call for t in turns for call in t["up"]}
    if not sets:
        assert up <= ALLOWED_UP, sorted(up - ALLOWED_UP)
    else:  # past the fence, a die's turns out of the iterations ask DieWatch (core's hook) too
        through_the_hook = {
            call
            for call in up
            if call.startswith("ranks/core/decode_die.py:")
            and " -> ranks/recovery/watch.py:" in call
        }
        assert up - through_the_hook <= ALLOWED_UP, sorted(up - through_the_hook - ALLOWED_UP)
    assert "ranks/core/decode_die.py:step -> ranks/recovery/watch.py:answer" in up  # it measures
