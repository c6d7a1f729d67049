"""`nanovllm serve` in a subprocess, for tests and benchmarks: start it, wait until it is
healthy, stop it with a signal. Standard library only.

Without a port, the server binds port 0 (a free one the kernel picks) and the address is
read from its log: no other process can take the port between choosing and binding it.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HEALTH_POLL_S = 0.2
# What the server logs once it listens (nanovllm.entrypoints.openai.api_server.Server.startup).
SERVING_ON = re.compile(r"serving on (http://\S+)")


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str | None  # None until wait_ready has read it from the log (port 0)
    log: Path | None = None  # where its stdout and stderr go, if not to ours

    def wait_ready(self, timeout: float) -> None:
        """Wait until GET /health answers 200; raise if the server exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}{self._log_tail()}")
            if self.base_url is None:
                found = SERVING_ON.search(self.log.read_text())
                self.base_url = found[1] if found else None
            elif self._healthy():
                return
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"the server was not healthy after {timeout:g} s{self._log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send sig (unless it has exited) and return its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)

    def _log_tail(self) -> str:
        return f":\n{self.log.read_text()[-4000:]}" if self.log is not None else ""


def process_gone(pid: int) -> bool:
    """Whether no process has this id (e.g. a server's engine process after the server exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def launch_server(model: str, flags: list[str], port: int | None = None, log: Path | None = None,
                  env: dict[str, str] | None = None, own_process_group: bool = False) -> ServerProcess:
    """Start `python -m nanovllm serve MODEL --port PORT *flags` on 127.0.0.1; returns at once.
    Without a port, the server picks one and `log` (needed then) tells wait_ready which.
    own_process_group: start it in a session of its own, so that its process group can
    be signalled as a service manager would."""
    if port is None and log is None:
        raise ValueError("launch_server without a port needs a log file to read the port from")
    command = [sys.executable, "-m", "nanovllm", "serve", model, "--port", str(port or 0), *flags]
    with open(log if log is not None else os.devnull, "w") as out:  # the child keeps its own copy of the file
        process = subprocess.Popen(command, stdout=out if log else None, stderr=subprocess.STDOUT if log else None,
                                   env=env, start_new_session=own_process_group)
    return ServerProcess(process, f"http://127.0.0.1:{port}" if port else None, log)
