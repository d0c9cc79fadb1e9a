"""The compiled methods of the project's dataclasses, kept once for every rank.

`@dataclass` writes the source text of each class's __init__, __repr__, __eq__, __hash__ (and,
frozen, __setattr__ and __delattr__) and compiles it with `exec`, in every process, every time
the class is defined: bytecode caching does not reach it. A die defines about 80 dataclasses
while importing, and compiling their ~440 methods was about half of its import CPU (~0.1 s of
~0.2 s on a quiet machine). So the launcher compiles them once (launch/job/dataclass_cache.py
`write_cache`, in a child that imports what every role imports) and a rank's `use_cache`
(launch/job/rank.py, before its imports) lets `dataclasses` exec the cached code objects instead;
`release` (ranks/core/ready.py, once the rank is built) ends it. This module is that runtime part:
it imports nothing of the project, so a rank can turn it on before any project dataclass exists.

The cache is keyed by the whole generated text, so it cannot hand a class another class's code:
a dataclass changed since the cache was written (or one the launcher's child never imported)
finds no entry and is compiled as before. A missing, unreadable or foreign file means no cache
at all. The file sits beside the package's bytecode, named by the interpreter's cache tag
(marshal's format is the interpreter's), and is rewritten when a project source is newer.
"""

from __future__ import annotations

import builtins
import dataclasses
import marshal
import sys
from pathlib import Path

CACHE = (
    Path(__file__).resolve().parent
    / "__pycache__"
    / f"dataclasses.{sys.implementation.cache_tag}.marshal"
)


class CachedExec:
    """`exec` for the dataclasses module: source texts found in `codes` run their cached code
    object; any other text is compiled as `exec` would and, recording, kept in `codes`."""

    def __init__(self, codes: dict[str, object], *, record: bool = False) -> None:
        self.codes, self.record = codes, record
        self.hits = 0
        self.missed: list[str] = []  # the modules of the texts compiled here, one per method

    def __call__(self, source, globals=None, locals=None, /):
        if isinstance(source, str):
            code = self.codes.get(source)
            if code is None:
                self.missed.append((globals or {}).get("__name__", "?"))
                code = compile(source, "<string>", "exec", dont_inherit=True)
                if self.record:
                    self.codes[source] = code
            else:
                self.hits += 1
            source = code
        return builtins.exec(source, globals, locals)


def use_cache(path: Path = CACHE) -> CachedExec | None:
    """Define dataclasses from here on with the methods cached in `path`; None (nothing
    changed) where there is no readable cache. Under `write_cache`, its recording stays."""
    if isinstance(getattr(dataclasses, "exec", None), CachedExec):
        return dataclasses.exec
    try:
        with open(path, "rb") as f:  # loads(read()): marshal.load reads a file in small
            codes = marshal.loads(f.read())  # pieces, far slower (docs/scale.md)
    except (OSError, EOFError, ValueError, TypeError):
        return None
    if not isinstance(codes, dict):
        return None
    cached = CachedExec(codes)
    dataclasses.exec = cached  # the module's `exec` lookups find this before the builtin
    return cached


def release() -> None:
    """Start-up is over (the rank is built): back to the builtin `exec`, and the cache's code
    objects that no class uses freed (kept, the main job's ranks held ~2 MiB more PSS)."""
    cached = vars(dataclasses).pop("exec", None)
    if isinstance(cached, CachedExec):
        cached.codes.clear()
