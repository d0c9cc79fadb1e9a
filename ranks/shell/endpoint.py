"""How requests from the HTTP endpoint reach the TE-shell's serving loop and how their tokens
come back, without the HTTP server ever holding up MPI progress.

Two threads, one rule: only the serving loop (the rank's main thread, `Frontend.serve`) calls
MPI. The HTTP server (ranks/shell/openai_api.py) runs in a thread of its own, on its own asyncio
event loop, and never waits for the serving loop:

    HTTP thread                          serving loop (main thread, MPI)
    -----------                          -------------------------------
    Endpoint.submit / cancel  --queue-->  EndpointFeed.turn: Endpoint.take (never blocks)
                                             -> Frontend.admit / Frontend.cancel
    Stream (asyncio.Queue)  <--loop.call_soon_threadsafe--  Endpoint.publish(deltas)
                                             <- EndpointFeed.turn: the turn's new tokens

Step 1: the HTTP thread parses and checks a request, gives it an id and a `Stream`, and puts a
  `Submit` on a thread-safe queue (`Endpoint.submit`); a client gone away puts a `Cancel`.
Step 2: each turn of the serving loop takes what is queued (`Endpoint.take`) into the
  frontend, which dispatches through the DP load balancer as it does the workload's requests.
Step 3: the tokens the dies streamed back this turn go out as one `Delta` per request, handed
  to the event loop in one call (`Endpoint.publish`); each reaches its request's `Stream`.
Step 4: shutdown (SIGINT/SIGTERM to the TE-shell, or run.timeout_s close) stops new requests
  (503), then drains or cancels the open ones (serve.on_shutdown); the loop ends when none is
  left, and the HTTP server closes after the last delta went out.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

from aiohttp import web

from ranks.shell.serve_records import RecordCap
from xds_mpi.config.serve import ServeConfig
from xds_mpi.workload.requests import Request

API_KEY_ENV = "XDS_SERVE_API_KEY"  # the key is never on the mpiexec line (it lists the config)
PID_FILE_ENV = "XDS_SERVE_PID_FILE"  # where launch/serve/command.py reads this rank's pid
START_TIMEOUT_S = 30.0  # the HTTP thread binds its socket within this


@dataclass(frozen=True, kw_only=True)
class Submit:
    """A checked request for the serving loop; `arrived_at` is time.time() when it came in."""

    req: Request
    arrived_at: float


@dataclass(frozen=True, kw_only=True)
class Cancel:
    """End a request early: its client went away, or a stop string ended its text."""

    req_id: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Delta:
    """What one serving-loop turn adds to one request.

    tokens: the token ids sampled since the last delta (the EOS token included).
    finish_reason: "" while running; "length" (max_tokens), "stop" (EOS) or "abort" (cancelled
    at shutdown, or its KV lost to a memory fault: `abort_reason` says which).
    die_rank: the DP group (its die's rank) serving it; -1 before dispatch.
    prefill_rank: PD: the prefill die that prefilled it (-1 before, and off PD).
    projected_ttft_s / projected_tpot_s: the request on the 910C virtual clock (nan until known).
    """

    req_id: int
    tokens: tuple[int, ...]
    finish_reason: str = ""
    abort_reason: str = ""
    die_rank: int = -1
    prefill_rank: int = -1
    projected_ttft_s: float = float("nan")
    projected_tpot_s: float = float("nan")


class Stream:
    """One request's deltas on the HTTP side (lives on the event loop)."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.deltas: asyncio.Queue[Delta] = asyncio.Queue()

    async def next(self) -> Delta:
        return await self.deltas.get()


class Endpoint:
    """The HTTP server's thread and the two queues between it and the serving loop.

    Serving-loop side: `start`, `take`, `publish`, `set_ready`, `set_failing_over`,
    `stop_accepting`, `close`.
    HTTP side (on the event loop): `submit`, `cancel`, `num_open`, `is_ready`,
    `is_failing_over`, `is_accepting`.
    """

    def __init__(self, cfg: ServeConfig, make_app, log) -> None:
        self.cfg, self.log = cfg, log
        self.api_key = os.environ.get(API_KEY_ENV, "")
        self.make_app = make_app  # (endpoint) -> aiohttp.web.Application
        self.inbox: queue.SimpleQueue[Submit | Cancel] = queue.SimpleQueue()
        self.streams: dict[int, Stream] = {}  # HTTP side only
        self.next_id = itertools.count()
        self.is_ready = False  # every die up (GET /health)
        self.is_failing_over = False  # a die silent: fenced, judged, scaled away (GET /health)
        self.is_accepting = True  # False once shutting down: new requests get 503
        self.shutdown_requested = False  # set by SIGINT/SIGTERM
        self.port = cfg.port
        self.loop: asyncio.AbstractEventLoop | None = None
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    # -- serving-loop side ------------------------------------------------------------------

    def start(self) -> None:
        """Bind and serve in the HTTP thread; SIGINT/SIGTERM ask for shutdown from now on."""
        self._thread.start()
        if not self._bound.wait(START_TIMEOUT_S):
            raise TimeoutError(f"serve: the HTTP server did not start in {START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise RuntimeError(
                f"serve: cannot listen on {self.cfg.host}:{self.cfg.port}: {self._error}"
            ) from self._error
        for signo in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signo, self._on_signal)
        if os.environ.get(PID_FILE_ENV):  # launch/serve/command.py signals this rank alone
            with open(os.environ[PID_FILE_ENV], "w") as f:
                f.write(str(os.getpid()))
        # The launcher (launch/serve/command.py) and the tests read this line for the address.
        print(f"serving on http://{self.cfg.host}:{self.port}", flush=True)

    def take(self) -> list[Submit | Cancel]:
        """Every command the HTTP thread queued since the last turn (never blocks)."""
        taken = []
        while True:
            try:
                taken.append(self.inbox.get_nowait())
            except queue.Empty:
                return taken

    def publish(self, deltas: list[Delta]) -> None:
        """Hand a turn's deltas to the event loop: one wake-up for all of them."""
        if deltas and self.loop is not None:
            self.loop.call_soon_threadsafe(self._deliver, deltas)

    def set_ready(self) -> None:
        """Every die up: GET /health 200, requests taken."""
        self.is_ready = True

    def set_failing_over(self, is_failing_over: bool) -> None:
        """GET /health 503 while true; requests are still taken (queued until the survivors
        serve again)."""
        self.is_failing_over = is_failing_over

    def stop_accepting(self) -> None:
        self.is_accepting = False

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the HTTP server once the deltas published so far went out; join its thread."""
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._end_streams)
            self.loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.log.warning("serve: the HTTP thread did not stop in %g s", timeout_s)
        for signo in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signo, signal.SIG_DFL)

    def _on_signal(self, signo, _frame) -> None:
        if self.shutdown_requested and signo == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.log.info("serve: %s: shutting down", signal.Signals(signo).name)
        self.shutdown_requested = True

    # -- HTTP side (runs on the event loop) ----------------------------------------------------

    def submit(self, req: Request) -> Stream:
        """Register `req` (its req_id from `new_id`) and queue it for the serving loop."""
        stream = Stream(req)
        self.streams[req.req_id] = stream
        self.inbox.put(Submit(req=req, arrived_at=time.time()))
        return stream

    def new_id(self) -> int:
        return next(self.next_id)

    def cancel(self, req_id: int, reason: str) -> None:
        """The client no longer wants `req_id`: the serving loop ends it and frees its KV."""
        if self.streams.pop(req_id, None) is not None:
            self.inbox.put(Cancel(req_id=req_id, reason=reason))

    @property
    def num_open(self) -> int:
        """Requests submitted whose last delta has not arrived (the 429 limit counts these)."""
        return len(self.streams)

    def _deliver(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            stream = self.streams.get(delta.req_id)
            if stream is None:
                continue  # cancelled by its client meanwhile
            if delta.finish_reason:
                del self.streams[delta.req_id]
            stream.deltas.put_nowait(delta)

    def _end_streams(self) -> None:
        """Requests that came in after the serving loop's last turn: aborted, never served."""
        self._deliver(
            [
                Delta(req_id=r, tokens=(), finish_reason="abort", abort_reason="shutdown")
                for r in list(self.streams)
            ]
        )

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self._stopped = asyncio.Event()
        # handler_cancellation: a client that goes away cancels its handler (its request too).
        runner = web.AppRunner(
            self.make_app(self), handle_signals=False, access_log=None, handler_cancellation=True
        )
        try:
            self.loop.run_until_complete(runner.setup())
            # A burst of max_queued clients connecting at once must fit the accept queue
            # (aiohttp's default is 128), even while the serving loop holds the GIL.
            backlog = max(128, 2 * self.cfg.max_queued)
            site = web.TCPSite(runner, self.cfg.host, self.cfg.port, backlog=backlog)
            self.loop.run_until_complete(site.start())
            self.port = runner.addresses[0][1]
        except OSError as exc:
            self._error = exc
            self._bound.set()
            return
        self._bound.set()
        self.loop.run_until_complete(self._stopped.wait())
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()


class EndpointFeed:
    """The serving loop's side of the endpoint: each turn, requests in and deltas out.

    `frontend` is the TE-shell's Frontend (ranks/shell/frontend.py): `admit`, `cancel`,
    `records`, `num_open`, `touched`. The feed is open (the run goes on) until shutdown has
    drained or cancelled every request."""

    def __init__(self, endpoint: Endpoint, frontend, metrics, *, deadline: float, cap=None) -> None:
        self.endpoint, self.frontend, self.metrics = endpoint, frontend, metrics
        # finished records let go past a cap (ranks/shell/serve_records.py); None: keep all
        self.cap = cap if cap is not None else RecordCap(None, 0, None)
        self.batches: list = []  # TokenBatches taken since the last turn (for /metrics)
        self.cfg = endpoint.cfg
        self.deadline = deadline  # time.monotonic(): run.timeout_s less a margin to shut down
        # req_id -> tokens published, of the requests whose last delta has not gone out
        self.num_published: dict[int, int] = {}
        self.drain_until: float | None = None
        self.is_open = True
        self.num_detections = 0  # failures counted on /metrics so far

    def turn(self) -> int:
        """Take the queued commands, publish this turn's deltas, move shutdown on."""
        commands = self.endpoint.take()
        for command in commands:
            if isinstance(command, Submit):
                self.frontend.admit(command.req, command.arrived_at)
            else:
                self.frontend.cancel(command.req_id, command.reason)
        self._shutdown_step()
        self.publish()
        self._measure()
        self.cap.trim(self.frontend.records)
        return len(commands)

    def _measure(self) -> None:
        """/metrics from the serving loop's side: queue and KV gauges, the dies' batches."""
        frontend, m = self.frontend, self.metrics
        balancer = frontend.balancer
        # dispatched, not finished (PD: at a prefill die, their KV on the way, or decoding)
        m.running.set(frontend.num_open - len(frontend.queue))
        m.waiting.set(len(frontend.queue))
        capacity = balancer.capacity * max(len(balancer.groups), 1)
        m.kv_usage.set(sum(balancer.reserved.values()) / capacity)
        for batch in self.batches:
            die = str(batch.die_rank)
            m.iteration.labels(die).observe(batch.iteration_s)
            m.xccl.labels(die).observe(batch.xccl_s)
            for step in batch.steps:
                m.draft_tokens.inc(len(step.drafts))
                m.accepted_tokens.inc(step.num_accepted)
        self.batches = []
        detections = frontend.detector.detections if frontend.detector is not None else ()
        for _ in range(len(detections) - self.num_detections):
            m.failures.inc()
        self.num_detections = len(detections)

    def took(self, batch) -> None:
        """A TokenBatch the frontend took from a die (its timings go to /metrics)."""
        self.batches.append(batch)

    def ready(self) -> None:
        """Every die up, the serving loop turning: GET /health 200."""
        self.endpoint.set_ready()

    def failing_over(self, is_failing_over: bool) -> None:
        """GET /health answers 503 from the fence until the survivors serve again."""
        self.endpoint.set_failing_over(is_failing_over)

    def publish(self) -> None:
        touched, self.frontend.touched = self.frontend.touched, set()
        deltas = [self._delta(req_id) for req_id in sorted(touched)]
        self.endpoint.publish(deltas)

    def _delta(self, req_id: int) -> Delta:
        record = self.frontend.records[req_id]
        # A finished request is touched no more (were it, the HTTP side has let go of its
        # stream and drops the delta): nothing is kept for it.
        done = self.num_published.pop(req_id, 0)
        tokens = tuple(record.tokens[done:])
        finish = finish_reason(record)
        if not finish:
            self.num_published[req_id] = len(record.tokens)
        else:
            self.cap.note_finished(req_id)
        ttft, tpot = self.frontend.projected_times(req_id)
        return Delta(
            req_id=req_id,
            tokens=tokens,
            finish_reason=finish,
            abort_reason=record.cancelled or record.lost,
            die_rank=record.die_rank,
            prefill_rank=self.frontend.prefill_rank(req_id),
            projected_ttft_s=ttft,
            projected_tpot_s=tpot,
        )

    def _shutdown_step(self) -> None:
        """Step 4: on a signal or near run.timeout_s, stop taking requests; drain or cancel."""
        if not self.is_open:
            return
        now = time.monotonic()
        if self.drain_until is None and (self.endpoint.shutdown_requested or now > self.deadline):
            self.endpoint.stop_accepting()
            self.drain_until = now + (
                self.cfg.drain_timeout_s if self.cfg.on_shutdown == "drain" else 0.0
            )
            self.frontend.log.info(
                "serve: no new requests; %s %d open ones",
                "draining" if self.cfg.on_shutdown == "drain" else "cancelling",
                self.frontend.num_open,
            )
        if self.drain_until is None:
            return
        if now >= self.drain_until:
            for req_id in self.frontend.open_requests():
                self.frontend.cancel(req_id, "shutdown")
        if not self.frontend.num_open and self.endpoint.inbox.empty():
            self.is_open = False


def finish_reason(record) -> str:
    """The OpenAI finish_reason of a finished record ("" while it runs)."""
    if record.cancelled or record.lost:
        return "abort"
    if not record.finished_at:
        return ""
    return "length" if len(record.tokens) >= record.req.max_new_tokens else "stop"
