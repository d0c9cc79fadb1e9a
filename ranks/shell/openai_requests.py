"""The OpenAI-style request bodies `xds-mpi serve` accepts, checked before anything is queued.

A body the endpoint cannot serve raises `ApiError` with the status and the OpenAI error object
the client gets (`{"error": {"message", "type", "param", "code"}}`); nothing reaches the
serving loop. What is refused and why:
- not JSON, not an object, a field of the wrong type, a missing prompt or messages: 400;
- a model other than serve.model: 404 (`model_not_found`), as the OpenAI API answers;
- n or best_of > 1, logprobs, echo, suffix, logit_bias, tools: 400 (one sequence of text);
- sampling other than greedy (temperature, top_p, top_k, min_p, penalties): 400, because every
  served token is checked against the greedy single-process reference (`--check`);
- a prompt or max_tokens that does not fit the model's length or a die's KV capacity: 400,
  with `xds_mpi.workload.requests.rejection`'s numbers.

The chat template over the byte tokenizer (docs/serve.md): BOS, then for each message
`<|role|>\\n` + its content + `\\n`, then `<|assistant|>\\n`; the reply is the bytes generated.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.schema import Config
from xds_mpi.model.tokenizer import ByteTokenizer
from xds_mpi.workload.requests import Request, rejection

DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default, used for chat too
MAX_STOP = 4  # stop strings per request, as the OpenAI API
CHAT_ROLES = ("system", "user", "assistant")
# Parameters that only have meaning with sampling, and the value that means "greedy".
GREEDY = {
    "temperature": (0, 0.0),
    "top_p": (1, 1.0),
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
}
# Parameters asking for output this endpoint does not produce, with the value that asks nothing.
NOT_PRODUCED = {
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "response_format": ({"type": "text"},),
}


class ApiError(Exception):
    """An OpenAI-style error: HTTP `status` and the body's error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return {
            401: "authentication_error",
            404: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


@dataclass(frozen=True, kw_only=True)
class Job:
    """A checked request. prompt: token ids (the chat template applied); stop: strings that end
    the text (not included); include_usage: a last chunk with `usage` when streaming."""

    is_chat: bool
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    ignore_eos: bool

    def request(self, req_id: int) -> Request:
        return Request(
            req_id=req_id,
            prompt=self.prompt,
            max_new_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
        )


def parse_job(body, cfg: Config, *, is_chat: bool) -> Job:
    """The Job a request body asks for; ApiError when it cannot be served (see the module)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}")
    model = _typed(body, "model", str, required=True)
    if model != cfg.serve.model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this endpoint serves `{cfg.serve.model}`",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(body)
    stream = _typed(body, "stream", bool, default=False)
    options = _typed(body, "stream_options", dict, default=None)
    if options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream")
    include_usage = _typed(
        options or {}, "include_usage", bool, default=False, where="stream_options."
    )
    prompt = _chat_prompt(body) if is_chat else _completion_prompt(body)
    key = "max_completion_tokens" if is_chat and body.get("max_tokens") is None else "max_tokens"
    max_tokens = _typed(body, key, int, default=DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise ApiError(400, f"{key} must be >= 1, got {max_tokens}", param=key)
    job = Job(
        is_chat=is_chat,
        prompt=tuple(prompt),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        stop=_stop(body),
        ignore_eos=_typed(body, "ignore_eos", bool, default=False),
    )
    reason = rejection(job.request(-1), cfg)
    if reason:
        raise ApiError(400, f"this request cannot be served: {reason}", param=key)
    return job


def _refuse_unsupported(body: dict) -> None:
    for key in ("n", "best_of"):
        n = _typed(body, key, int, default=1)
        if n != 1:
            raise ApiError(
                400, f"{key}({n}): this endpoint returns one sequence per request", param=key
            )
    for key, greedy in GREEDY.items():
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or value not in greedy):
            raise ApiError(
                400,
                f"{key}({value!r}) is not supported: the emulator decodes greedily and checks "
                f"every token against the greedy single-process reference; omit {key} or send "
                f"{greedy[0]!r}",
                param=key,
            )
    for key, nothing in NOT_PRODUCED.items():
        value = body.get(key)
        if value is not None and value not in nothing:
            raise ApiError(
                400,
                f"{key}({value!r}) is not supported by this endpoint; omit it",
                param=key,
            )


def _completion_prompt(body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return ByteTokenizer().encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(
            400, f"prompt: a batch of {len(prompt)} prompts; send one per request", param="prompt"
        )
    raise ApiError(
        400,
        f"prompt must be a string or a list of token ids, got {_kind(prompt)}",
        param="prompt",
    )


def _chat_prompt(body: dict) -> list[int]:
    messages = _typed(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "messages must hold at least one message", param="messages")
    text = ""
    for i, message in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object, got {_kind(message)}")
        role = _typed(message, "role", str, required=True, where=where)
        if role not in CHAT_ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role({role!r}) must be one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{i}].role",
            )
        text += f"<|{role}|>\n{_content(message, where)}\n"
    return ByteTokenizer().encode(text + "<|assistant|>\n")


def _content(message: dict, where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(
        400,
        f"{where}content must be a string or a list of text parts, got {_kind(content)}",
        param=f"{where}content",
    )


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(
            400,
            f"stop must be a non-empty string or a list of them, got {_kind(stop)}",
            param="stop",
        )
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop: {len(stop)} strings > {MAX_STOP}", param="stop")
    return tuple(stop)


def _typed(body: dict, key: str, tp: type, *, default=None, required=False, where=""):
    """body[key] when it has type `tp` (a bool is no int), `default` when absent or null."""
    value = body.get(key)
    if value is None:
        if required:
            raise ApiError(400, f"{where}{key} is required", param=where + key)
        return default
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ApiError(
            400,
            f"{where}{key} must be {_TYPE_NAMES[tp]}, got {_kind(value)} {value!r:.40}",
            param=where + key,
        )
    return value


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", dict: "an object"}
_TYPE_NAMES[list] = "an array"


def _kind(value) -> str:
    return {
        type(None): "null",
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)
