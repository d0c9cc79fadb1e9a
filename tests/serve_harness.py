"""A live `xds-mpi serve` for tests: on 127.0.0.1 and a free port, under a timeout, always
stopped (SIGTERM to the launcher: the TE-shell drains, checks and ends every rank; a second
SIGTERM, then SIGKILL, if it does not)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = re.compile(r"check: (\d+) requests, (\d+) tokens, (\d+) mismatches")
RUN_FILE = re.compile(r"run file (\S+\.h5)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *args: str, api_key: str = "", timeout_s: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = tmp / "serve.log"
        argv = [sys.executable, "-m", "launch.cli", "serve", "--port", str(self.port), "--check"]
        argv += ["--set", f"run.output_dir={tmp}", "--set", f"run.timeout_s={timeout_s}"]
        argv += [*args] + (["--api-key", api_key] if api_key else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.output = ""

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"xds-mpi serve ended early:\n{self.log_path.read_text()}")
            try:
                status, _ = self.get("/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready in {timeout_s} s:\n{self.log_path.read_text()}")

    def headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def get(self, path: str) -> tuple[int, str]:
        return self.request("GET", path, None)

    def post(self, path: str, body, *, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, text = self.request("POST", path, data, headers)
        return status, json.loads(text)

    def request(self, method: str, path: str, data, headers=None) -> tuple[int, str]:
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers=self.headers() if headers is None else headers,
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def stop(self, timeout_s: float = 150) -> str:
        """SIGTERM (a drain, the check, the run file); the launcher's whole output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)  # the launcher ends every rank
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.log.close()
        self.output = self.log_path.read_text()
        return self.output

    def check_line(self) -> tuple[int, int, int]:
        found = CHECK.search(self.output)
        assert found, f"no check line in:\n{self.output[-3000:]}"
        return tuple(int(g) for g in found.groups())

    def run_file(self) -> Path:
        found = RUN_FILE.search(self.output)
        assert found, f"no run file named in:\n{self.output[-3000:]}"
        return Path(found.group(1))
