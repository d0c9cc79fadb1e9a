"""The HTTP routes of `xds-mpi serve` (aiohttp), on the endpoint's event loop.

POST /v1/completions, POST /v1/chat/completions (with `stream: true`: server-sent events ending
in `data: [DONE]`), GET /v1/models, GET /health (503 until every die is up, while a failover
is in progress, and while shutting down), GET /metrics (ranks/shell/serve_metrics.py). With an
API key ($XDS_SERVE_API_KEY) every /v1/ route wants `Authorization: Bearer KEY` (401 without).
Each response carries, beside the OpenAI fields, `xds`: the request's id in the run file, the
die (DP group) that served it (PD: the prefill die too), and its TTFT and TPOT projected on
the 910C.
"""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field

from aiohttp import web

from ranks.shell.endpoint import Delta, Endpoint, Stream
from ranks.shell.openai_requests import ApiError, Job, parse_job
from ranks.shell.serve_metrics import ServeMetrics
from xds_mpi.model.tokenizer import NUM_BYTES

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def make_app(
    endpoint: Endpoint,
    cfg,
    metrics: ServeMetrics,
    dp_group_of: dict[int, int],
    prefill_group_of: dict[int, int],
):
    """The aiohttp application of `endpoint` (its factory: Endpoint runs it in its thread).
    dp_group_of: decode die rank -> its DP group; prefill_group_of: PD's prefill die rank -> its
    prefill DP group ({} off PD)."""
    api = Api(endpoint, cfg, metrics, Groups(decode=dp_group_of, prefill=prefill_group_of))
    app = web.Application(
        middlewares=[api.errors, api.auth], client_max_size=cfg.serve.max_body_bytes
    )
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics_text)
    return app


class TextOut:
    """A request's text, token by token: UTF-8 across token boundaries, and stop strings (the
    text ends before the first one; the last len(longest stop) - 1 characters wait until they
    cannot start one)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.num_sent = "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.is_stopped = False

    def add(self, tokens: tuple[int, ...]) -> str:
        """The text that can go out now."""
        self.text += self.decoder.decode(bytes(t for t in tokens if t < NUM_BYTES))
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.text, self.is_stopped = self.text[: min(found)], True
            return self._send(len(self.text))
        return self._send(len(self.text) - self.hold)

    def finish(self) -> str:
        if not self.is_stopped:
            self.text += self.decoder.decode(b"", final=True)
        return self._send(len(self.text))

    def _send(self, upto: int) -> str:
        if upto <= self.num_sent:
            return ""
        out, self.num_sent = self.text[self.num_sent : upto], upto
        return out


@dataclass(frozen=True, kw_only=True)
class Groups:
    """Die rank -> DP group: `decode` the groups requests decode on, `prefill` PD's prefill
    groups ({} off PD: no prefill fields in `xds`)."""

    decode: dict[int, int]
    prefill: dict[int, int]


@dataclass(kw_only=True)
class Served:
    """What a request got so far, for its response."""

    job: Job
    req_id: int
    arrived: float = field(default_factory=time.monotonic)
    num_tokens: int = 0
    finish_reason: str = ""
    last: Delta | None = None
    last_token_at: float = 0.0

    def extension(self, groups: Groups) -> dict:
        """The `xds` field: where it was served (PD: where it was prefilled too) and its
        projected 910C times."""
        last = self.last
        die = last.die_rank if last else -1
        out = {
            "req_id": self.req_id,
            "die_rank": die,
            "dp_group": groups.decode.get(die, -1),
        }
        if groups.prefill:
            prefill = last.prefill_rank if last else -1
            out["prefill_die_rank"] = prefill
            out["prefill_dp_group"] = groups.prefill.get(prefill, -1)
        out["projected_ttft_ms"] = _ms(last.projected_ttft_s) if last else None
        out["projected_tpot_ms"] = _ms(last.projected_tpot_s) if last else None
        return out

    def usage(self) -> dict:
        prompt = len(self.job.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_tokens,
            "total_tokens": prompt + self.num_tokens,
        }


def _ms(seconds: float) -> float | None:
    return None if seconds != seconds else round(seconds * 1e3, 6)  # nan: not known


class Api:
    def __init__(self, endpoint: Endpoint, cfg, metrics: ServeMetrics, groups: Groups) -> None:
        self.endpoint, self.cfg, self.metrics = endpoint, cfg, metrics
        self.model = cfg.serve.model
        self.groups = groups
        self.created = int(time.time())

    # -- middlewares ----------------------------------------------------------------------------

    @web.middleware
    async def errors(self, request: web.Request, handler):
        """Every refusal as an OpenAI error object, counted by status."""
        try:
            return await handler(request)
        except ApiError as exc:
            return self._error_response(exc)
        except web.HTTPRequestEntityTooLarge as exc:
            return self._error_response(
                ApiError(
                    413,
                    f"request body over serve.max_body_bytes({self.cfg.serve.max_body_bytes})",
                    code=str(exc.status),
                )
            )
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._error_response(ApiError(exc.status, exc.reason))

    def _error_response(self, exc: ApiError) -> web.Response:
        self.metrics.http_errors.labels(str(exc.status)).inc()
        return web.json_response(exc.body(), status=exc.status)

    @web.middleware
    async def auth(self, request: web.Request, handler):
        key = self.endpoint.api_key
        if key and request.path.startswith("/v1/"):
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)")
        return await handler(request)

    # -- routes ---------------------------------------------------------------------------------

    async def models(self, _request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "xds-mpi",
            "max_model_len": self.cfg.model.max_seq_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, _request: web.Request) -> web.Response:
        if not self.endpoint.is_ready:
            return web.json_response({"status": "not ready: dies starting"}, status=503)
        if self.endpoint.is_failing_over:
            return web.json_response(
                {"status": "failing over: a die was lost; the others rebuild"}, status=503
            )
        if not self.endpoint.is_accepting:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics_text(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.text(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, is_chat=True)

    # -- serving one request --------------------------------------------------------------------

    async def _serve(self, request: web.Request, *, is_chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        job = parse_job(body, self.cfg, is_chat=is_chat)
        stream = self._submit(job)
        served = Served(job=job, req_id=stream.req.req_id)
        self.metrics.prompt_tokens.inc(len(job.prompt))
        try:
            if job.stream:
                return await self._stream(request, stream, served)
            return await self._whole(stream, served)
        except BaseException:  # the client went away (cancelled handler, reset connection)
            if not served.finish_reason:
                self.endpoint.cancel(served.req_id, "client disconnected")
                self.metrics.cancelled.labels("client disconnected").inc()
            raise

    def _submit(self, job: Job) -> Stream:
        endpoint = self.endpoint
        if not endpoint.is_ready:
            raise ApiError(503, "not ready: dies starting (see GET /health)")
        if not endpoint.is_accepting:
            raise ApiError(503, "shutting down: no new requests")
        if endpoint.num_open >= self.cfg.serve.max_queued:
            raise ApiError(
                429,
                f"{endpoint.num_open} requests open >= serve.max_queued"
                f"({self.cfg.serve.max_queued}); retry later",
            )
        return endpoint.submit(job.request(endpoint.new_id()))

    async def _next(self, stream: Stream, served: Served, text: TextOut) -> str:
        """The next delta's text; notes tokens, finish and latencies."""
        delta = await stream.next()
        now = time.monotonic()
        if delta.tokens:
            if not served.num_tokens:
                self.metrics.ttft.observe(now - served.arrived)
            else:
                gap = (now - served.last_token_at) / len(delta.tokens)
                for _ in delta.tokens:
                    self.metrics.itl.observe(gap)
            served.last_token_at = now
        served.num_tokens += len(delta.tokens)
        served.last = delta
        self.metrics.generation_tokens.inc(len(delta.tokens))
        out = text.add(delta.tokens)
        if text.is_stopped and not delta.finish_reason:  # a stop string: end it on its die
            self.endpoint.cancel(served.req_id, "stop string")
            self.metrics.cancelled.labels("stop string").inc()
            served.finish_reason = "stop"
        elif text.is_stopped:
            served.finish_reason = "stop"
        elif delta.finish_reason:
            served.finish_reason = delta.finish_reason
            out += text.finish()
        if served.finish_reason:
            self._finished(served)
        return out

    def _finished(self, served: Served) -> None:
        m = self.metrics
        m.success.labels(self.model, served.finish_reason).inc()
        m.e2e.observe(time.monotonic() - served.arrived)
        last = served.last
        if last is not None and last.projected_ttft_s == last.projected_ttft_s:
            m.projected_ttft.observe(last.projected_ttft_s)
        if last is not None and last.projected_tpot_s == last.projected_tpot_s:
            m.projected_tpot.observe(last.projected_tpot_s)
        if served.finish_reason == "abort" and last is not None:
            m.cancelled.labels(last.abort_reason or "aborted").inc()

    async def _whole(self, stream: Stream, served: Served) -> web.Response:
        text, parts = TextOut(served.job.stop), []
        while not served.finish_reason:
            parts.append(await self._next(stream, served, text))
        if served.finish_reason == "abort" and not served.num_tokens:
            raise ApiError(503, f"request aborted: {served.last.abort_reason}")
        content = "".join(parts)
        if served.job.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}}
        else:
            choice = {"index": 0, "text": content, "logprobs": None}
        choice["finish_reason"] = served.finish_reason
        body = self._head(served, chunk=False)
        body.update(choices=[choice], usage=served.usage(), xds=served.extension(self.groups))
        return web.json_response(body)

    async def _stream(self, request: web.Request, stream: Stream, served: Served):
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        text, job = TextOut(served.job.stop), served.job
        if job.is_chat:  # the first chunk names the role, as the OpenAI API
            await self._send(response, served, {"role": "assistant", "content": ""}, None)
        while not served.finish_reason:
            out = await self._next(stream, served, text)
            if out or served.finish_reason:
                content = {"content": out} if job.is_chat else out
                await self._send(response, served, content, served.finish_reason or None)
        if job.include_usage:
            chunk = self._head(served, chunk=True)
            chunk.update(choices=[], usage=served.usage(), xds=served.extension(self.groups))
            await _event(response, chunk)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _send(self, response, served: Served, content, finish_reason) -> None:
        chunk = self._head(served, chunk=True)
        if served.job.is_chat:
            choice = {"index": 0, "delta": content, "logprobs": None}
        else:
            choice = {"index": 0, "text": content, "logprobs": None}
        choice["finish_reason"] = finish_reason
        chunk["choices"] = [choice]
        if finish_reason:
            chunk["xds"] = served.extension(self.groups)
        await _event(response, chunk)

    def _head(self, served: Served, *, chunk: bool) -> dict:
        if served.job.is_chat:
            kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        return {
            "id": f"{prefix}-{served.req_id}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
        }


async def _event(response: web.StreamResponse, chunk: dict) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
