"""`ServerProcess`: run `nanoqwen-cli serve` as a subprocess on a free loopback port (tests, bench).

    with ServerProcess(model_path, "--device", "cpu") as srv:
        srv.url            # http://127.0.0.1:PORT
        srv.metric("nanoqwen_kv_blocks_used")
    code = srv.terminate()   # SIGTERM, wait, the exit code

The port is chosen by the server (`--port 0`) and read from its "ready on http://HOST:PORT/v1" line,
so two servers never race for a port. stderr goes to a file (`log_path`) that tests can read.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["ServerProcess", "parse_metrics"]

_READY = re.compile(r"ready on (http://[\d.]+:\d+)/v1")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series (name plus labels, as written): value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class ServerProcess:
    def __init__(self, model: str | Path, *args: str, start_timeout_s: float = 300.0,
                 env: dict | None = None):
        self.model = Path(model)
        self.args = [str(a) for a in args]
        self.start_timeout_s = start_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log_path = Path(tempfile.mkstemp(prefix="nanoqwen-serve-", suffix=".log")[1])

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "nanoqwen_cli.main", "serve", str(self.model), "--host", "127.0.0.1",
               "--port", "0", "--log-level", "warning", *self.args]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in terminate()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            m = _READY.search(self.log())
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready:\n"
                                   + self.log())
            time.sleep(0.1)
        self.terminate()
        raise TimeoutError(f"server not ready after {self.start_timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return parse_metrics(text)

    def metric(self, series: str) -> float:
        return self.metrics()[series]

    def wait_metric(self, series: str, value: float, timeout_s: float = 30.0) -> float:
        """Poll until `series` equals `value` (returns it) or the timeout passes (returns the last)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.metrics().get(series)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    def terminate(self, timeout_s: float = 120.0) -> int:
        """SIGTERM and wait; the exit code (SIGKILL after `timeout_s`, then the code is negative)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.terminate()
