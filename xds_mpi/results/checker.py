"""The served run's checker process: `--check` on the records the TE-shell let go of.

A served run past `record_cap.MAX_RECORDS_ENV` finished records hands the oldest ones to this
process (`python -m xds_mpi.results.checker`; here, not under ranks/, so that it never imports
a rank's code, which starts MPI) instead of keeping them until the stop
(ranks/shell/serve_records.py).
Protocol, pickles on its stdin and stdout:

1. in: the run's Config;
2. in: lists of finished RequestRecords, each checked against the single-process reference at
   once (`check_against_reference`) and then dropped;
3. in: None (no more); out: the totals over every list, (requests, tokens, mismatch lines): a
   tuple, since this module runs as __main__ here and as itself in the TE-shell.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class CheckTotals:
    """num_requests, num_tokens: compared with the reference; mismatches: one line each."""

    num_requests: int = 0
    num_tokens: int = 0
    mismatches: list[str] = field(default_factory=list)

    def add(self, num_requests: int, num_tokens: int, mismatches: list[str]) -> None:
        self.num_requests += num_requests
        self.num_tokens += num_tokens
        self.mismatches += mismatches


def main() -> int:
    # Imported here: the TE-shell imports this module for CheckTotals, not the reference.
    from xds_mpi.model.weights import build_model
    from xds_mpi.results.results import check_against_reference

    inbox, outbox = sys.stdin.buffer, sys.stdout.buffer
    cfg = pickle.load(inbox)
    model = build_model(cfg.model)  # once: built for every list, its RSS grew list by list
    totals = CheckTotals()
    while (records := pickle.load(inbox)) is not None:
        by_id = {r.req.req_id: r for r in records}
        totals.add(*check_against_reference(cfg, by_id, model))
    pickle.dump((totals.num_requests, totals.num_tokens, totals.mismatches), outbox)
    outbox.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
