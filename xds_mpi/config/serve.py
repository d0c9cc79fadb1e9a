"""The `serve` section: the OpenAI-compatible endpoint `xds-mpi serve` opens on the TE-shell
(ranks/shell/endpoint.py). Off unless `serve.enabled`; `xds-mpi serve` sets it, with the
command-line flags as the other keys. The API key never goes through the config (it would show
on the mpiexec line): the TE-shell reads it from $XDS_SERVE_API_KEY.

Part of the config schema (`xds_mpi.config.schema` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import non_negative, positive, require


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """enabled: the TE-shell serves HTTP requests instead of the workload section's, until it is
    told to shut down (SIGINT/SIGTERM) or run.timeout_s runs out.
    model: the name /v1/models lists and requests must give.
    max_queued: requests admitted but not yet finished beyond which a new one gets 429.
    max_body_bytes: a request body over this gets 413.
    on_shutdown: "drain" finishes the requests in flight (up to drain_timeout_s, then cancels the
    rest); "cancel" cancels them at once.
    """

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port, named on the TE-shell's "serving on" line
    model: str = "xds-tiny"
    max_queued: int = 256
    max_body_bytes: int = 1 << 20
    on_shutdown: Literal["drain", "cancel"] = "drain"
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        positive("serve", max_queued=self.max_queued, max_body_bytes=self.max_body_bytes)
        non_negative("serve", port=self.port, drain_timeout_s=self.drain_timeout_s)
        require(self.port <= 65535, f"serve.port must be <= 65535, got {self.port}")
        require(bool(self.model), "serve.model must name the served model, got ''")
        require(bool(self.host), "serve.host must name an address to bind, got ''")
