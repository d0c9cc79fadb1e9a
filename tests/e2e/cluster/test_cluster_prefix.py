"""A cluster's TEs with their own EMS pools (docs/routing.md): 2 colocated TEs x 2 dies, each
with one pool rank on its own communicator (9 ranks), `--check` 0 mismatches, and `prefix`
routing each request to the TE that holds its prefix, so the TEs' pools serve every hit a
single pool would, where round_robin scatters the prompts and loses most of them. The JE sums
the TEs' EMS counts and writes the decision log. Each run is bounded by the subprocess timeout
and run.timeout_s."""

from __future__ import annotations

import json
import subprocess

import h5py
from harness import REPO_ROOT
from test_serving import XDS_MPI, check_line
from test_virtual_time import _sets

BT = 16  # configs/colocated.yaml's scheduler.kv_block_tokens: one 512-token hash id at 1/32
# (arrival ms, hash ids): a 512-token id serves one 16-token block; 2 s apart, so every puts
# land before the next lookup. Requests 0 and 1 come together: the second goes to the idle TE.
CRAFTED = [
    (0, [1, 2, 3]),
    (0, [6, 7, 8]),
    (2000, [1, 2, 3, 4]),  # 3 blocks of request 0 (the 4th holds the last token)
    (4000, [1, 2, 5]),  # 2 blocks of request 0
    (6000, [6, 7, 8, 9]),  # 3 blocks of request 1
    (8000, [1, 2, 3]),  # 2 blocks of request 0 (the 3rd holds the last token)
]
# prefix: 0 -> TE 0, 1 -> TE 1 (TE 0 busy), then each to its prefix's TE: 4 hits, 10 blocks.
# round_robin: 0 1 0 1 0 1: request 2 hits 3 blocks on TE 0, request 5 the 2 blocks (1, 2)
# request 3 put on TE 1; 3 and 4 find nothing: 2 hits, 5 blocks.
EXPECTED = {
    "prefix": ([0, 1, 0, 0, 1, 0], 4, 10, [0, 0, 48, 32, 48, 32]),
    "round_robin": ([0, 1, 0, 1, 0, 1], 2, 5, None),
}


def _serve(tmp_path, policy: str) -> tuple[dict, dict]:
    path = tmp_path / "crafted.jsonl"
    rows = [
        json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 64,
                    "hash_ids": ids})
        for t, ids in CRAFTED
    ]  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    sets = _sets(
        "cluster.num_tes=2", f"cluster.policy={policy}", "deployment.dp_groups_per_domain=2",
        "ems.enabled=true", "ems.servers=1", "workload.source=trace", f"trace.path={path}",
        "trace.length_scale=0.03125", "trace.output_scale=0.0625", "run.timeout_s=120",
        f"run.output_dir={tmp_path}", f"run.name={policy}",
    )  # fmt: skip
    result = subprocess.run(
        [str(XDS_MPI), "run", "colocated", "--check", *sets],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert check_line(result) == "check: 6 requests, 24 tokens, 0 mismatches"
    with h5py.File(tmp_path / f"{policy}.h5", "r") as f:
        log = {k: v[()] for k, v in f["cluster/decisions"].items()}
        return dict(f["summary"].attrs), log


def test_prefix_routes_to_the_te_holding_the_prefix_and_its_pool_serves_every_hit(tmp_path):
    for policy, (tes, hits, blocks, prefix) in EXPECTED.items():
        summary, log = _serve(tmp_path, policy)
        assert log["te"].tolist() == tes, policy
        assert summary["ems_requests_hit"] == hits, policy
        assert summary["ems_blocks_hit"] == blocks, policy
        assert summary["ems_tokens_skipped"] == blocks * BT, policy
        assert summary["te0_ems_requests_hit"] + summary["te1_ems_requests_hit"] == hits
        assert summary["ems_fallbacks"] == 0 and summary["regret_requests"] == 6
        if prefix is not None:  # the tree's prefix of the chosen TE is what its pool served
            chosen = log["prefix_tokens"][range(6), log["te"]]
            assert chosen.tolist() == prefix and sum(prefix) == blocks * BT
