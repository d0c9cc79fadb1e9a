"""`--check` with MTP compares every decode step's drafts and accepted count with the reference's
own MTP loop: a die step and a reference step are the same thing (the first one after prefill
verifies the prefill's MTP drafts; a last step cut by max_new_tokens counts what it accepted), and
a die that drafts one wrong token fails the check although it serves the greedy tokens."""

from __future__ import annotations

import re
import subprocess

import h5py
import pytest
from harness import REPO_ROOT, TESTS_DIR, explain, run_mpi
from test_serving import XDS_MPI, check_line

from xds_mpi.config.schema import load_config
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
from xds_mpi.model.tokenizer import EOS_ID
from xds_mpi.model.weights import build_model
from xds_mpi.plan.topology import Topology
from xds_mpi.results.results import RequestRecord, check_against_reference
from xds_mpi.scheduling.scheduler import DieScheduler, Sampled, VerifiedDrafts
from xds_mpi.workload.requests import Request
from xds_mpi.workload.stream import load_workload

PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 100, 101, 102, 32, 102, 105, 98], [1, 77, 111, 69]]
MAX_NEW = 7
COLOCATED = REPO_ROOT / "configs" / "colocated.yaml"


def scheduler(depth: int) -> DieScheduler:
    return DieScheduler(
        table=BlockTable(num_blocks=64, block_tokens=4),
        max_batch=4,
        max_tokens=64,
        prefill_chunk=64,
        eos_id=EOS_ID,
        ignore_eos=True,
        mtp_depth=depth,
    )


def test_a_decode_step_carries_its_drafts_and_the_accepted_count_before_the_cut():
    s = scheduler(depth=2)
    s.add(Request(req_id=0, prompt=(10, 11, 12), max_new_tokens=4))
    s.schedule()
    [prefill] = s.postprocess({0: Sampled(tokens=(1,), drafts=(2, 3))})
    assert prefill.step is None  # the prefill's token is no step
    s.schedule()
    first, second = s.postprocess({0: Sampled(tokens=(2, 9), drafts=(4, 5))})
    assert first.step == VerifiedDrafts(req_id=0, drafts=(2, 3), num_accepted=1)
    assert second.step is None
    s.schedule()
    [last] = s.postprocess({0: Sampled(tokens=(4, 5, 6))})  # max_new_tokens keeps only 4
    assert (last.token, last.is_finished) == (4, True)
    assert last.step == VerifiedDrafts(req_id=0, drafts=(4, 5), num_accepted=2)


def serve_reference_steps(req_id: int, out, depth: int) -> RequestRecord:
    """What the TE-shell records when a die's scheduler commits the reference's steps: the
    prefill token with the drafts of its MTP pass, then each step's accepted drafts plus one
    token (tokens past the cut are never emitted, so any value will do)."""
    s = scheduler(depth)
    req = Request(req_id=req_id, prompt=out.prompt, max_new_tokens=MAX_NEW)
    record = RequestRecord(req=req)
    s.add(req)
    verified, start = [out.tokens[:1]], 1
    for accepted in out.step_accepted:
        padded = (*out.tokens[start : start + accepted + 1], *[0] * (accepted + 1))
        verified.append(padded[: accepted + 1])
        start += accepted + 1
    for tokens, next_drafts in zip(verified, [*out.step_drafts, ()]):
        s.schedule()
        for e in s.postprocess({req_id: Sampled(tokens=tuple(tokens), drafts=next_drafts)}):
            record.add_token(e.token, 0.0)
            if e.step:
                record.add_step(e.step.drafts, e.step.num_accepted)
    assert not s.running  # finished on the reference's last step
    return record


@pytest.mark.parametrize("depth", [1, 2])
def test_die_steps_line_up_with_reference_steps_and_one_wrong_draft_is_a_mismatch(depth):
    cfg = load_config(COLOCATED, [f"scheduler.mtp_depth={depth}", "workload.ignore_eos=true"])
    options = GenerateOptions(
        max_new_tokens=MAX_NEW,
        mtp_depth=depth,
        use_int8=True,
        ignore_eos=True,
        block_tokens=cfg.scheduler.kv_block_tokens,
    )
    outs = ReferenceGenerator(build_model(cfg.model), options).generate(PROMPTS)
    for out in outs:
        assert len(out.step_drafts) == len(out.step_accepted) == out.num_steps
        assert sum(map(len, out.step_drafts)) == out.num_drafted == depth * out.num_steps
        assert sum(out.step_accepted) == out.num_accepted
    assert sum(o.num_accepted for o in outs) > 0
    # Some request's last step accepted past max_new_tokens: both sides count it uncut.
    assert any(1 + o.num_accepted + o.num_steps > MAX_NEW for o in outs)
    records = {i: serve_reference_steps(i, out, depth) for i, out in enumerate(outs)}
    assert check_against_reference(cfg, records) == (3, 3 * MAX_NEW, [])

    drafts = list(records[2].step_drafts[1])
    drafts[0] = (drafts[0] + 1) % cfg.model.vocab_size
    records[2].step_drafts[1] = tuple(drafts)
    accepted = records[2].step_accepted[1]
    assert check_against_reference(cfg, records)[2] == [
        f"request 2: step 1 drafted {drafts} and accepted {accepted}, the reference drafted "
        f"{list(outs[2].step_drafts[1])} and accepted {accepted}"
    ]
    records[2].step_drafts[1] = outs[2].step_drafts[1]
    records[2].add_step((), 0)
    assert check_against_reference(cfg, records)[2] == [
        f"request 2: {outs[2].num_steps + 1} decode steps served, {outs[2].num_steps} in the "
        "reference"
    ]


PERTURBED = [
    "deployment.dp_groups_per_domain=2",
    "scheduler.mtp_depth=1",
    "workload.num_requests=4",
    "workload.output_len=6",
    "workload.prompt_len=12",
    "workload.ignore_eos=true",
    "run.check=true",
    "run.name=perturbed",
]


def test_one_wrong_draft_on_one_die_fails_the_check_though_every_token_is_right(tmp_path):
    settings = [*PERTURBED, f"run.output_dir={tmp_path}"]
    cfg = load_config(COLOCATED, settings)
    args = [
        str(TESTS_DIR / "perturb_rank.py"),
        str(COLOCATED),
        *[a for s in settings for a in ("--set", s)],
    ]
    result = run_mpi(Topology.from_config(cfg, None).world_size, args, timeout_s=240)
    assert result.returncode != 0 and not result.timed_out, explain(result)
    [changed] = re.findall(r"perturbed: die 1 request (\d+) draft (\d+) -> (\d+)", result.output)
    req_id, old, new = map(int, changed)
    [line] = [ln for ln in result.output.splitlines() if ln.startswith("check: 4 requests")]
    num_mismatches = int(
        re.fullmatch(r"check: 4 requests, 24 tokens, (\d+) mismatches", line).group(1)
    )
    assert num_mismatches >= 1, explain(result)
    assert re.search(
        rf"check: request {req_id}: step 0 drafted \[{new}\] and accepted \d, "
        rf"the reference drafted \[{old}\] and accepted \d",
        result.output,
    )
    with h5py.File(tmp_path / "perturbed.h5", "r") as f:
        assert f["summary"].attrs["check_mismatches"] == num_mismatches
        assert f["requests/die_rank"][req_id] == 1
        served = [list(t) for t in f["requests/tokens"][()]]
        step_drafts = list(f["requests/step_drafts"][req_id])
    # A tokens-only check would have passed: the run served plain greedy decoding's tokens.
    prompts = [list(r.prompt) for r in load_workload(cfg)]
    greedy = ReferenceGenerator(
        build_model(cfg.model), GenerateOptions(max_new_tokens=6, use_int8=True, ignore_eos=True)
    ).generate(prompts)
    assert served == [list(o.tokens) for o in greedy]
    assert step_drafts[0] == new  # the run file keeps the drafted token


# colocated depth 1 and afd depth 2 repeat tests/e2e/serving/test_serving.py and
# tests/e2e/afd/test_serving_afd.py's MTP runs (--check compares every draft there too): they
# run with --long.
@pytest.mark.parametrize(
    "config,depth",
    [
        pytest.param("colocated", 1, marks=pytest.mark.long),
        ("colocated", 2),
        pytest.param("afd", 2, marks=pytest.mark.long),
    ],
)
def test_unperturbed_runs_draft_what_the_reference_drafts_step_by_step(tmp_path, config, depth):
    settings = [
        f"scheduler.mtp_depth={depth}",
        "scheduler.prefill_chunk_tokens=7",
        "workload.num_requests=6",
        "workload.output_len=8",
        "workload.prompt_len=12",
        f"run.output_dir={tmp_path}",
        "run.name=serve",
        "run.timeout_s=240",
    ]
    result = subprocess.run(
        [str(XDS_MPI), "run", config, "--check", *[a for s in settings for a in ("--set", s)]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check_line(result) == "check: 6 requests, 48 tokens, 0 mismatches"
    with h5py.File(tmp_path / "serve.h5", "r") as f:
        summary = f["summary"].attrs
        num_drafts = f["requests/step_num_drafts"][()]
        num_accepted = f["requests/step_num_accepted"][()]
        drafts = f["requests/step_drafts"][()]
        assert summary["mtp_accepted"] > 0
        assert sum(n.sum() for n in num_drafts) == summary["mtp_drafted"]
        assert sum(n.sum() for n in num_accepted) == summary["mtp_accepted"]
    for steps, accepted, tokens in zip(num_drafts, num_accepted, drafts):
        assert len(steps) == len(accepted) > 0 and (steps == depth).all()
        assert len(tokens) == steps.sum() and (accepted <= depth).all()
