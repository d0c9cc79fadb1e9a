"""Many colocated TEs behind one job executor (docs/cluster.md): `xds-mpi run --check` with
cluster.num_tes=2 (7 ranks: the JE and 2 x [TE-shell + 2 dies]) equals the single-process
reference whichever TE served a request, both TEs serve, the virtual columns are the same beside
busy processes, and least_load and round_robin route a long request then short ones as they
must. Each run is bounded by the subprocess timeout and run.timeout_s."""

from __future__ import annotations

import subprocess

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT, busy_processes
from test_serving import XDS_MPI, check_line
from test_virtual_time import _jsonl, _sets, _virtual_columns

CLUSTER = _sets(
    "cluster.num_tes=2",
    "deployment.dp_groups_per_domain=2",
    "workload.ignore_eos=true",
    "run.timeout_s=240",
)


def run_cluster(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, h5py.File | None]:
    result = subprocess.run(
        [
            str(XDS_MPI),
            "run",
            "colocated",
            "--check",
            *_sets(f"run.output_dir={tmp_path}", "run.name=cluster"),
            *CLUSTER,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    path = tmp_path / "cluster.h5"
    return result, (h5py.File(path, "r") if path.exists() else None)


def _ok(result: subprocess.CompletedProcess) -> str:
    return result.stdout[-4000:] + result.stderr[-3000:]


# The burst tests' autoscaler: out above 2 requests waiting per serving TE, in below 0.5, over
# windows of 0.5 s, decisions 1 s apart, a scale-out's one fixed step 0.5 s.
AUTOSCALE = (
    "autoscaler.enabled=true",
    "autoscaler.scale_out_above=2",
    "autoscaler.scale_in_below=0.5",
    "autoscaler.window_s=0.5",
    "autoscaler.cooldown_s=1",
    "autoscaler.scale_out_s=0.5",
)


def assert_all_checked(result: subprocess.CompletedProcess, lines: list) -> None:
    """A burst of 12-token requests (`lines`) all served, every token the reference's."""
    assert result.returncode == 0, _ok(result)
    expected = f"check: {len(lines)} requests, {12 * len(lines)} tokens, 0 mismatches"
    assert check_line(result) == expected


def run_mixed(out, *sets: str, name: str = "mixed"):
    """configs/cluster.yaml (TEs 0 and 1 colocated, TE 2 a PD pair) serving 18 requests at 12/s
    with `sets` on top: (the finished process, its run file or None)."""
    result = subprocess.run(
        [
            str(XDS_MPI),
            "run",
            "cluster",
            "--check",
            *_sets(
                f"run.output_dir={out}",
                f"run.name={name}",
                "run.timeout_s=240",
                "workload.num_requests=18",
                "workload.rate_per_s=12",
                "workload.ignore_eos=true",
                *sets,
            ),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    path = out / f"{name}.h5"
    return result, (h5py.File(path, "r") if path.exists() else None)


def cluster_columns(run_file) -> dict:
    """The run file's virtual columns and each request's TE and routing time."""
    columns = _virtual_columns(run_file)
    columns["cluster/te"] = run_file["cluster/te"][()]
    columns["cluster/routed_s"] = run_file["cluster/routed_s"][()]
    return columns


def assert_same_columns(quiet: dict, loaded: dict) -> None:
    assert quiet.keys() == loaded.keys()
    for name in quiet:
        assert np.array_equal(quiet[name], loaded[name], equal_nan=True), name


def test_validate_shows_the_je_and_the_ranks_of_each_te():
    result = subprocess.run(
        [str(XDS_MPI), "validate", "colocated", "--brief", *CLUSTER],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, _ok(result)
    assert (
        "cluster: 2 TEs (2 x 3-rank colocated) behind one JE, policy round_robin, world size 7"
        in result.stdout
    )
    assert "  JE: world rank 0\n" in result.stdout
    assert "  TE 0 (colocated, 2 dies): world ranks 1..3 (TE-shell 1;" in result.stdout
    assert "  TE 1 (colocated, 2 dies): world ranks 4..6 (TE-shell 4;" in result.stdout


def test_two_tes_check_against_the_reference_and_the_same_virtual_times_beside_busy_processes(
    tmp_path,
):
    workload = _sets(
        "cluster.policy=least_load",
        "workload.num_requests=16",
        "workload.arrival=rate",
        "workload.rate_per_s=20",
        "workload.length_dist=uniform",
        "workload.max_prompt_len=32",
        "workload.max_output_len=12",
        "workload.output_len=4",
    )
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = run_cluster(tmp_path / f"run{i}", *workload)
        assert result.returncode == 0, _ok(result)
        assert check_line(result).startswith("check: 16 requests, ")
        assert check_line(result).endswith(" 0 mismatches")
        assert run_file.attrs["world_size"] == 7 and run_file.attrs["status"] == "completed"
        assert run_file["summary"].attrs["check_mismatches"] == 0
        te = run_file["cluster/te"][()]
        assert sorted(set(te)) == [0, 1]  # both TEs served
        # each request's die is a die of its TE, by world rank
        die = run_file["requests/die_rank"][()]
        first = run_file["cluster/te_first_rank"][()]
        assert all(first[t] < d < first[t] + 3 for t, d in zip(te, die, strict=True))
        assert sorted(run_file["dies"]) == ["2", "3", "5", "6"]
        runs.append(cluster_columns(run_file))
    quiet, loaded = runs
    assert_same_columns(quiet, loaded)
    # routed at the arrival: the JE never holds a request back
    assert np.array_equal(quiet["cluster/routed_s"], quiet["virtual/arrival_s"])


def test_a_pd_pair_and_two_colocated_tes_check_and_keep_their_virtual_times_beside_busy_processes(
    tmp_path,
):
    # configs/cluster.yaml: TEs 0 and 1 colocated (3 ranks each), TE 2 a PD pair (its JE, its
    # decode TE-shell, 1 prefill die, 2 decode dies), 12 ranks.
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = run_mixed(tmp_path / str(i))
        assert result.returncode == 0, _ok(result)
        assert check_line(result).startswith("check: 18 requests, ")
        assert check_line(result).endswith(" 0 mismatches")
        assert run_file.attrs["world_size"] == 12
        assert [k.decode() for k in run_file["cluster/te_kind"][()]] == ["colocated"] * 2 + ["pd"]
        te = run_file["cluster/te"][()]
        assert sorted(set(te)) == [0, 1, 2]  # the pair serves too
        # the pair's own PD results (TTFT split, KV transfers) under /cluster/te2/pd
        pd_ids = set(run_file["cluster/te2/pd/req_id"][()])
        assert pd_ids == set(run_file["cluster/req_id"][()][te == 2])
        assert "pd" not in run_file["cluster/te0"] and "slo" in run_file["cluster/te0"]
        # each request's (decode) die is a die of its TE, by world rank
        die, first = run_file["requests/die_rank"][()], run_file["cluster/te_first_rank"][()]
        size = run_file["cluster/te_size"][()]
        assert all(first[t] < d < first[t] + size[t] for t, d in zip(te, die, strict=True))
        runs.append(cluster_columns(run_file))
    assert_same_columns(*runs)


def test_least_load_and_round_robin_route_a_long_request_then_short_ones_as_they_must(tmp_path):
    # One long request (90 tokens, ~3 virtual seconds) and four short ones (2 tokens, each done
    # within the 0.4 s until the next): round_robin alternates whatever the load, least_load
    # sends every short one to the TE without the long one.
    lines = [{"prompt_ids": list(range(5, 17)), "max_tokens": 90, "arrival_s": 0.0}] + [
        {"prompt_ids": list(range(20 + i, 32 + i)), "max_tokens": 2, "arrival_s": 0.4 * i}
        for i in range(1, 5)
    ]
    expected = {"round_robin": [0, 1, 0, 1, 0], "least_load": [0, 1, 1, 1, 1]}
    for policy, tes in expected.items():
        result, run_file = run_cluster(
            tmp_path / policy, *_jsonl(tmp_path, lines), *_sets(f"cluster.policy={policy}")
        )
        assert result.returncode == 0, _ok(result)
        assert check_line(result) == "check: 5 requests, 98 tokens, 0 mismatches"
        assert list(run_file["cluster/te"][()]) == tes, policy
        finish, arrival = run_file["virtual/finish_s"][()], run_file["virtual/arrival_s"][()]
        # the premise: the long request runs past every short arrival, each short one ends
        # before the next arrives
        assert finish[0] > arrival[-1]
        assert all(finish[i] < arrival[i] + 0.4 for i in range(1, 5))
        assert run_file["cluster"].attrs["policy"] == policy


def test_two_afd_tes_check_against_the_reference(tmp_path):
    # configs/afd.yaml twice (each TE: its TE-shell, attention dies and expert dies), 17 ranks
    result = subprocess.run(
        [
            str(XDS_MPI),
            "run",
            "afd",
            "--check",
            *_sets(
                f"run.output_dir={tmp_path}",
                "run.name=afd",
                "run.timeout_s=240",
                "cluster.num_tes=2",
                "workload.num_requests=8",
            ),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, _ok(result)
    assert check_line(result) == "check: 8 requests, 128 tokens, 0 mismatches"
    run_file = h5py.File(tmp_path / "afd.h5", "r")
    assert [k.decode() for k in run_file["cluster/te_kind"][()]] == ["afd", "afd"]
    assert sorted(set(run_file["cluster/te"][()])) == [0, 1]


def test_a_lost_te_s_unfinished_requests_are_routed_again_once_found_and_equal_the_reference(
    tmp_path,
):
    # configs/cluster.yaml with colocated TE 0 lost whole at virtual 2.5 s; the JE finds it at
    # 2.5 + health.timeout_s (1.5) + health.dp_interval_s (0.2) = 4.2 s.
    result, run_file = run_mixed(
        tmp_path, "cluster.te_losses=[{te: 0, at_s: 2.5}]", "health.timeout_s=1.5", name="lost"
    )
    assert result.returncode == 0, _ok(result)
    assert check_line(result).startswith("check: 18 requests, ")
    assert check_line(result).endswith(" 0 mismatches")
    cluster = run_file["cluster"]
    te, first = cluster["te"][()], cluster["first_te"][()]
    routed, finish = cluster["routed_s"][()], run_file["virtual/finish_s"][()]
    again = first != te
    assert again.sum() >= 1  # the premise: TE 0 held unfinished requests at 2.5 s
    assert run_file["summary"].attrs["rerouted_requests"] == again.sum()
    assert set(first[again]) == {0} and 0 not in set(te[again])
    assert np.allclose(routed[again], 4.2)  # routed again when found, not before
    assert (te == 0).sum() >= 1  # the premise: TE 0 finished some before its loss
    assert all(finish[te == 0] <= 2.5)  # and nothing after
    arrival = run_file["virtual/arrival_s"][()]
    assert arrival[first == 0].max() < 4.2  # routed nothing once found
    assert cluster["te_status"][0].decode() == "lost at 2.5 s virtual, found at 4.2 s"
    assert np.isnan(cluster["te_lost_s"][1]) and cluster["te_found_s"][0] == 4.2


def test_a_te_given_no_request_ends_cleanly(tmp_path):
    # one request, two TEs: TE 1 never iterates (its projection has no iterations to show)
    result, run_file = run_cluster(tmp_path, *_sets("workload.num_requests=1"))
    assert result.returncode == 0, _ok(result)
    assert check_line(result) == "check: 1 requests, 16 tokens, 0 mismatches"
    assert list(run_file["cluster/te"][()]) == [0]
    assert "projection: no iterations" in result.stdout + result.stderr


def test_the_autoscaler_scales_out_on_a_burst_and_drains_after_it(tmp_path):
    # 1 TE serving + 2 standby (2 dies each); 1 request/s for 3 s, 16/s for 3 s, then 1/s for
    # 10 s: the burst's load scales out (each new TE serving 0.5 s after the decision), the
    # quiet after it drains them again.
    times = [float(t) for t in range(3)]
    times += [3 + i / 16 for i in range(48)] + [6.0 + t for t in range(1, 11)]
    lines = [
        {"prompt_ids": list(range(3 + i % 7, 19 + i % 7)), "max_tokens": 12, "arrival_s": t}
        for i, t in enumerate(times)
    ]
    groups = (
        "cluster.groups=[{count: 1, set: [deployment.dp_groups_per_domain=2]}, "
        "{count: 2, standby: true, set: [deployment.dp_groups_per_domain=2]}]"
    )
    result, run_file = run_cluster(
        tmp_path,
        *_jsonl(tmp_path, lines),
        *_sets(
            "cluster.num_tes=3",
            groups,
            "cluster.policy=least_load",
            *AUTOSCALE,
        ),
    )
    assert_all_checked(result, lines)
    scaling = run_file["cluster/scaling"]
    kinds = [k.decode() for k in scaling["kind"][()]]
    assert "out" in kinds and "in" in kinds, kinds  # the premise: both happened
    outs = np.array(kinds) == "out"  # each scale-out's one step: autoscaler.scale_out_s
    assert np.allclose(scaling["step_s"][()][outs].sum(axis=1), 0.5)
    te, routed = run_file["cluster/te"][()], run_file["cluster/routed_s"][()]
    assert (te == 1).sum() >= 3  # the premise: a scaled-out TE served part of the burst
    # a TE serves exactly from its scale-out + 0.5 s until it is drained, never otherwise
    for k in (1, 2):
        windows, start = [], None
        for kind, t, decided, serves in zip(
            kinds, scaling["te"][()], scaling["decided_s"][()], scaling["serves_s"][()], strict=True
        ):
            if t != k:
                continue
            if kind == "out":
                assert serves == pytest.approx(decided + 0.5)
                start = serves
            else:
                windows.append((start, decided))
                start = None
        if start is not None:
            windows.append((start, np.inf))
        for r in routed[te == k]:
            assert any(a <= r < b for a, b in windows), (k, r, windows)
    assert set(te[routed < 3.0]) == {0}  # before the burst only the first TE serves


def test_a_te_whose_die_is_lost_for_good_is_a_lost_te_and_keeps_its_virtual_times(tmp_path):
    # TE 0's die 2 dead at virtual 1.0 s; its experts have no other replica
    # (health.on_expert_lost stop): its TE-shell tells the JE the loss (the first iteration at or
    # after 1.0 s), stops its dies, and the JE routes its unfinished requests again once found,
    # health.timeout_s + dp_interval_s later. Alone, such a TE ends the whole job.
    faulty = _sets(
        "cluster.groups=[{count: 1, set: ['faults.events=[{kind: dead, die: 2, at_s: 1.0}]']}, "
        "{count: 1}]",
        "health.timeout_s=1.5",
        "workload.num_requests=24",
        "workload.rate_per_s=12",
        "workload.length_dist=uniform",
        "workload.max_output_len=12",
        "workload.output_len=2",
    )
    runs = []
    for i, num_busy in enumerate((0, 2)):
        with busy_processes(num_busy):
            result, run_file = run_cluster(tmp_path / f"run{i}", *faulty)
        assert result.returncode == 0, _ok(result)
        assert check_line(result).endswith(" 0 mismatches")
        cluster = run_file["cluster"]
        te, first = cluster["te"][()], cluster["first_te"][()]
        lost_s, found_s = cluster["te_lost_s"][0], cluster["te_found_s"][0]
        again = first != te
        assert again.sum() >= 1 and set(te[again]) == {1}  # its orphans went to TE 1
        assert (te == 0).sum() >= 1  # the premise: TE 0 finished some before its loss
        assert all(run_file["virtual/finish_s"][()][te == 0] <= lost_s)
        assert 1.0 <= lost_s < 1.5 and np.isclose(found_s, lost_s + 1.7)
        assert np.allclose(cluster["routed_s"][()][again], found_s)
        assert cluster["te_status"][0].decode().startswith("lost at ")
        runs.append(cluster_columns(run_file))
    assert_same_columns(*runs)
