"""The axes of the config matrix (tests/e2e/serving/test_config_matrix.py): what the validator
must either run token-exact or refuse before launch with a reason.

A combination is a tuple of value indices, one per axis. `overrides` turns it into `--set`
lines on top of configs/<kind>.yaml; `pairwise` picks a few accepted combinations that together
contain every pair of values (of two axes) that any accepted combination contains.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from harness import REPO_ROOT

JSONL = REPO_ROOT / "tests" / "data" / "matrix_requests.jsonl"

# Deployment axes decide acceptance; workload axes only change what is served.
DEPLOYMENT_AXES: dict[str, tuple] = {
    "kind": ("colocated", "afd"),
    "dies": (1, 2, 3, 5, 8),
    "shared": ("every_die", "dedicated"),
    "redundant": (0, 1),
    "int8": (True, False),
    "row_dtype": ("float64", "float32"),
    "mtp": (0, 1, 2),
    "microbatches": (1, 2),
    "domains": (1, 2),
    "prefill": (0, 2),  # prefill dies: 0 = no PD, else disaggregated prefill-decode
}
WORKLOAD_AXES: dict[str, tuple] = {
    "chunk": (5, 64),
    "lengths": ("fixed", "uniform", "long_tail"),
    "source": ("synthetic", "jsonl"),
}
AXES = {**DEPLOYMENT_AXES, **WORKLOAD_AXES}
NAMES = tuple(AXES)
# Small requests: a run stays short; ignore_eos gives exact token counts.
WORKLOAD = [
    "workload.num_requests=4",
    "workload.prompt_len=10",
    "workload.max_prompt_len=20",
    "workload.output_len=4",
    "workload.max_output_len=6",
    "workload.ignore_eos=true",
]


def values(combo: tuple[int, ...]) -> dict:
    return {name: AXES[name][i] for name, i in zip(NAMES, combo)}


def label(combo: tuple[int, ...]) -> str:
    v = values(combo)
    return (
        f"{v['kind']}-n{v['dies']}-{v['shared']}-r{v['redundant']}-"
        f"{'int8' if v['int8'] else v['row_dtype']}-mtp{v['mtp']}-m{v['microbatches']}-"
        f"d{v['domains']}-p{v['prefill']}-c{v['chunk']}-{v['lengths']}-{v['source']}"
    )


def dies_of(v: dict) -> list[str]:
    """A deployment of v['dies'] dies: colocated, all of them DP groups; afd, D domains of G
    attention dies (about half the dies) and the rest expert dies."""
    n, d = v["dies"], v["domains"]
    if v["kind"] == "colocated":
        return [f"deployment.dp_groups_per_domain={n}", f"deployment.num_dp_domains={d}"]
    groups = max(1, n // (2 * d))
    return [
        f"deployment.num_dp_domains={d}",
        f"deployment.dp_groups_per_domain={groups}",
        f"deployment.num_expert_dies={n - d * groups}",
    ]


def overrides(combo: tuple[int, ...]) -> tuple[str, list[str]]:
    """(config name, --set lines) of a combination."""
    v = values(combo)
    sets = dies_of(v) + [
        f"deployment.shared_experts={v['shared']}",
        f"deployment.num_shared_expert_dies={1 if v['shared'] == 'dedicated' else 0}",
        f"deployment.redundant_slots_per_die={v['redundant']}",
        f"deployment.num_microbatches={v['microbatches']}",
        f"xccl.use_int8={str(v['int8']).lower()}",
        f"xccl.row_dtype={v['row_dtype']}",
        f"scheduler.mtp_depth={v['mtp']}",
        f"scheduler.prefill_chunk_tokens={v['chunk']}",
        f"workload.length_dist={v['lengths']}",
        f"workload.source={v['source']}",
        *WORKLOAD,
    ]
    if v["prefill"]:  # the JE and the decode TE-shell; KV rings prefill -> decode
        sets += [
            "deployment.num_host_ranks=2",
            f"deployment.num_prefill_dies={v['prefill']}",
            "pd.enabled=true",
            "xccl.p2p_pairs=prefill_to_decode",
            "xccl.slot_bytes=16384",
        ]
    if v["source"] == "jsonl":
        sets.append(f"workload.path={JSONL}")
    return v["kind"], sets


def product(axes: dict[str, tuple]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(len(vals)) for vals in axes.values())))


def pairwise(candidates: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Greedy pairwise cover: repeatedly take the candidate with the most value pairs not yet
    covered (the first such, so the choice is the same every run) until every pair that some
    candidate holds is covered."""
    sizes = [len(v) for v in AXES.values()]
    axis_pairs = list(itertools.combinations(range(len(sizes)), 2))
    base = np.cumsum([0] + [sizes[i] * sizes[j] for i, j in axis_pairs])
    combos = np.array(candidates)  # [C, axes]
    pair_ids = np.stack(
        [base[k] + combos[:, i] * sizes[j] + combos[:, j] for k, (i, j) in enumerate(axis_pairs)],
        axis=1,
    )  # [C, pairs]
    is_covered = np.ones(base[-1], bool)
    is_covered[np.unique(pair_ids)] = False  # coverable, not yet covered
    chosen = []
    while not is_covered.all():
        gains = (~is_covered[pair_ids]).sum(axis=1)  # [C]
        best = int(gains.argmax())
        chosen.append(tuple(int(i) for i in combos[best]))
        is_covered[pair_ids[best]] = True
    return chosen


def config_path(kind: str) -> Path:
    return REPO_ROOT / "configs" / f"{kind}.yaml"
