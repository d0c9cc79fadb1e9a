"""A test-only rank entry: `launch.job.rank` with one die's MTP drafting perturbed once.

Run as `python -m mpi4py tests/perturb_rank.py CONFIG [--set section.key=value ...]` on a
colocated deployment. On die rank PERTURBED_RANK the first draft of the first request the die
drafts for becomes another token; every other rank, and every later draft, is untouched. The main
model rejects the wrong draft, so greedy MTP still serves the greedy tokens: only a check of the
drafts themselves can see it. The die names what it changed on stderr, for the test to match.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from launch.job.rank import main
from xds_mpi.execution.executor import ColocatedExecutor

PERTURBED_RANK = 1


def perturb_first_draft() -> None:
    """Wrap ColocatedExecutor._draft so its first drafting request gets one draft changed."""
    original = ColocatedExecutor._draft
    is_perturbed = False

    def draft(executor, works, spent) -> None:
        nonlocal is_perturbed
        original(executor, works, spent)
        drafting = [w for w in works.values() if w.is_drafting]
        if is_perturbed or not drafting:
            return
        work = drafting[0]
        old = work.drafts[0]
        work.drafts[0] = (old + 1) % executor.model.cfg.vocab_size
        is_perturbed = True
        print(
            f"perturbed: die {PERTURBED_RANK} request {work.req_id} draft {old} -> "
            f"{work.drafts[0]}",
            file=sys.stderr,
            flush=True,
        )

    ColocatedExecutor._draft = draft


if __name__ == "__main__":
    if MPI.COMM_WORLD.rank == PERTURBED_RANK:
        perturb_first_draft()
    main()
