"""NPU-fork to many and the source's slowdown (docs/scaling.md, "Fork to many"): 1 serving + 3
standby colocated TEs of 2 dies (13 ranks), the burst of test_cluster_fork.py with no cool-down,
so three scale-outs by fork come inside the first one's TE-Load (priced: 0.709 s). All three read
TE 0's dies, one fork group whose receivers are priced 1, 2, 3; every token equals the
reference's. Run again with scaling.fork_link_share=0 (no contention): the same decisions, and
the source dies' iterations longer only with the share, by the link's factor on their dispatch
and combine (a few of them: those starting inside the forks' TE-Load), none of the other dies'.
Each run is bounded by the subprocess timeout and run.timeout_s."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from test_cluster import _ok, assert_all_checked, run_cluster
from test_cluster_fork import _burst
from test_serving import check_line
from test_virtual_time import _sets

from xds_mpi.config.schema import load_config
from xds_mpi.scaling.steps import scale_out

GROUPS = (
    "cluster.groups=[{count: 1, set: [deployment.dp_groups_per_domain=2]}, "
    "{count: 3, standby: true, set: [deployment.dp_groups_per_domain=2, scaling.path=fork]}]"
)


def _run(tmp_path, share: float):
    lines, workload = _burst(tmp_path)
    result, _ = run_cluster(
        tmp_path,
        *workload,
        *_sets(
            "cluster.num_tes=4",
            GROUPS,
            "cluster.policy=least_load",
            "autoscaler.enabled=true",
            "autoscaler.scale_out_above=2",
            "autoscaler.scale_in_below=0.5",
            "autoscaler.window_s=0.5",
            "autoscaler.cooldown_s=0",
            f"scaling.fork_link_share={share}",
            f"run.name=share{share}",
        ),
    )
    assert result.returncode == 0, _ok(result)
    expected = f"check: {len(lines)} requests, {12 * len(lines)} tokens, 0 mismatches"
    assert check_line(result) == expected
    return h5py.File(tmp_path / f"share{share}.h5", "r")


def test_three_forks_share_one_source_whose_dies_are_slowed_while_read(tmp_path):
    charged, free = _run(tmp_path, 0.5), _run(tmp_path, 0.0)
    scaling = charged["cluster/scaling"]
    outs = np.array([k.decode() == "out" for k in scaling["kind"][()]])
    assert list(scaling["te"][outs]) == [1, 2, 3]
    assert list(scaling["load_source_te"][outs]) == [0, 0, 0]
    assert list(scaling["load_fork_group"][outs]) == [1, 1, 1]
    assert list(scaling["load_fork_receivers"][outs]) == [1, 2, 3]
    wall = scaling["load_fork_wall_s"][outs]
    assert np.all(wall == wall[0]) and 0 < wall[0] < 60
    # the k-th receiver's TE-Load: the chain adds one 64 MiB block (0.5 ms at 135 GB/s) and a hop
    serves = scaling["serves_s"][outs] - scaling["decided_s"][outs]
    assert np.all((4.9e-4 < np.diff(serves)) & (np.diff(serves) < 6e-4)), serves
    assert list(free["cluster/scaling/decided_s"][()]) == list(scaling["decided_s"][()])
    for rank in charged["dies"]:
        ours, theirs = charged[f"dies/{rank}/vtime_s"][()], free[f"dies/{rank}/vtime_s"][()]
        num = min(len(ours), len(theirs))
        longer = np.flatnonzero(ours[:num] > theirs[:num] * (1 + 1e-9))
        if rank in ("2", "3"):  # TE 0's dies, read by the forks
            assert 1 <= len(longer) <= 8, longer
            assert np.all(ours[longer] / theirs[longer] < 1.5)  # only dispatch and combine
        else:
            assert len(longer) == 0, (rank, longer)


def test_with_a_fan_out_each_join_reprices_the_forks_still_loading(tmp_path):
    """scaling.fork_fanout=3: TE 0 feeds the three new TEs at once, its link split three ways,
    so the second and third joins price the earlier members again: all three serve the 3rd
    receiver's steps after their own decisions (the chain: 1st, 2nd, 3rd), and every token
    still equals the reference's."""
    lines, workload = _burst(tmp_path)
    result, _ = run_cluster(
        tmp_path,
        *workload,
        *_sets(
            "cluster.num_tes=4",
            GROUPS,
            "cluster.policy=least_load",
            "autoscaler.enabled=true",
            "autoscaler.scale_out_above=2",
            "autoscaler.scale_in_below=0.5",
            "autoscaler.window_s=0.5",
            "autoscaler.cooldown_s=0",
            "scaling.fork_fanout=3",
            "run.name=fanout3",
        ),
    )
    assert_all_checked(result, lines)
    scaling = h5py.File(tmp_path / "fanout3.h5", "r")["cluster/scaling"]
    outs = np.array([k.decode() == "out" for k in scaling["kind"][()]])
    assert list(scaling["load_fork_receivers"][outs]) == [1, 2, 3]
    fork_cfg = load_config("configs/colocated.yaml", ["scaling.path=fork", "scaling.fork_fanout=3"])
    third = scale_out(fork_cfg, num_dies=32, num_new_tes=3)
    serves = scaling["serves_s"][outs] - scaling["decided_s"][outs]
    assert serves == pytest.approx([sum(s for _, s in third.steps)] * 3)
