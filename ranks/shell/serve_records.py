"""A served run's request records, bounded: past `max_records` finished records the TE-shell
lets the oldest quarter go, so that its memory stays flat whatever the number of requests served
(`xds-mpi serve --max-records`, docs/serve.md "Memory over a long run").

What goes and what stays:
- A record let go is counted (requests, tokens, and its tokens' wall times in TokenClock's
  0.1 s buckets) so that the summary's totals and a failure's tokens/s windows still cover
  every request; the run file's /requests, the TTFT / TPOT percentiles and the SLOs cover the
  records kept (the newest), and /summary says how many went (`num_records_dropped`).
- With `--check` each record let go is first handed to a checker process
  (xds_mpi/results/checker.py) that compares it with the reference at once, so the check at
  shutdown still covers every request (and no longer runs the reference on all of them then).
- Records of requests that were cancelled or lost stay: a token batch of a cancelled request
  may still be on its way, and a memory fault's record names its requests.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from dataclasses import replace
from queue import Queue

from ranks.recovery.records import RATE_WINDOW_S
from xds_mpi.results.checker import CheckTotals
from xds_mpi.results.record_cap import TokenClock

# Variables that would make the checker look like an MPI rank (to MPI and to a soak's watch).
_RANK_ENV_PREFIXES = ("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPI_LOCALRANKID")


class RecordCap:
    """Keeps a served Frontend's finished records under `max_records` (0: no cap). `trim` runs
    each turn of the serving loop; `finish` once serving ended: the checker's CheckTotals
    (None without a check)."""

    def __init__(self, cfg, max_records: int, log) -> None:
        self.cfg, self.max_records, self.log = cfg, max_records, log
        self.num_dropped = self.num_dropped_tokens = 0
        self.finished: list[int] = []  # req_ids in the order they finished, kept ones only
        self.tokens_gone = TokenClock()  # when the tokens of the records let go arrived
        self._checker: _Checker | None = None

    def note_finished(self, req_id: int) -> None:
        """A request's last delta went out."""
        if self.max_records:
            self.finished.append(req_id)

    def trim(self, records: dict) -> None:
        """Past max_records finished records, let the oldest quarter go (checked first)."""
        if not self.max_records or len(self.finished) <= self.max_records:
            return
        num_going = max(1, self.max_records // 4)
        going, self.finished = self.finished[:num_going], self.finished[num_going:]
        chunk = [records[req_id] for req_id in going if _can_go(records[req_id])]
        for record in chunk:
            del records[record.req.req_id]
        self.num_dropped += len(chunk)
        self.num_dropped_tokens += sum(len(r.tokens) for r in chunk)
        for record in chunk:
            self.tokens_gone.add(record.token_times)
        if self.cfg.run.check and chunk:
            if self._checker is None:
                self._checker = _Checker(self.cfg)
            self._checker.send(chunk)

    def finish(self) -> CheckTotals | None:
        if self.num_dropped:
            self.log.info(
                "records: let %d finished requests (%d tokens) go past %d kept (xds-mpi serve "
                "--max-records)%s",
                self.num_dropped,
                self.num_dropped_tokens,
                self.max_records,
                "; each checked by the checker process as it went" if self._checker else "",
            )
        return self._checker.close() if self._checker is not None else None

    def with_rates(self, failures: list, started: float) -> list:
        """`failures` (FailureRecords, times since `started`) with the tokens of the records let
        go added to their tokens/s windows, as ranks/recovery/records.py draws them: the
        RATE_WINDOW_S before the fault (from serving's start at the earliest) and after it, or
        after the dies resumed."""
        out = []
        for f in failures:
            if f.injected_wall_s < 0 or not self.num_dropped:
                out.append(f)
                continue
            at = started + f.injected_wall_s
            after = started + f.resumed_wall_s if f.resumed_wall_s > 0 else at
            before_s = at - max(at - RATE_WINDOW_S, started)
            out.append(
                replace(
                    f,
                    tokens_per_s_before=f.tokens_per_s_before
                    + (self.tokens_gone.count(at - before_s, at) / before_s if before_s else 0.0),
                    tokens_per_s_after=f.tokens_per_s_after
                    + self.tokens_gone.count(after, after + RATE_WINDOW_S) / RATE_WINDOW_S,
                )
            )
        return out


def _can_go(record) -> bool:
    return bool(record.finished_at) and not record.cancelled and not record.lost


class _Checker:
    """The checker process and the thread that feeds it, so that the serving loop never waits
    for a pipe the checker has not read yet."""

    def __init__(self, cfg) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_RANK_ENV_PREFIXES)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xds_mpi.results.checker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.queue: Queue = Queue()
        self.queue.put(cfg)
        self.thread = threading.Thread(target=self._feed, name="serve-checker", daemon=True)
        self.thread.start()

    def send(self, records: list) -> None:
        self.queue.put(records)

    def close(self) -> CheckTotals:
        self.queue.put(None)
        self.thread.join()
        num_requests, num_tokens, mismatches = pickle.load(self.proc.stdout)
        self.proc.wait()
        return CheckTotals(num_requests=num_requests, num_tokens=num_tokens, mismatches=mismatches)

    def _feed(self) -> None:
        while True:
            item = self.queue.get()
            pickle.dump(item, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
            if item is None:
                self.proc.stdin.close()
                return
