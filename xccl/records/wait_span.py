"""A hook around XCCL's waits for peers: the caller's tracer sees how long each wait took apart
from the operation around it (xccl imports nothing of the project: the hook is passed in)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

# wait_span(name, **args) -> a context manager around one wait ("dispatch wait", event=...).
WaitSpan = Callable[..., AbstractContextManager]


def no_span(name: str, **args) -> AbstractContextManager:
    """The default hook: nothing recorded."""
    return nullcontext()
