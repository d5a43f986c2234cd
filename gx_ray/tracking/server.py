"""The local MLflow tracking server a sweep starts when it is given none: ``mlflow server`` on the loopback
interface, backed by SQLite and an artifact folder in the sweep's output.

Only the driver (and the report command) import this module; trial processes log through :mod:`gx_ray.tracking`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalMlflowServer:
    """``mlflow server`` on the loopback interface, backed by SQLite and an artifact folder under ``root``."""

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 180.0):
        self.root, self.host, self.port = Path(root).resolve(), host, port or free_port(host)
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def backend_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    def ui_command(self) -> str:
        """What a user runs later to browse the runs without the sweep."""
        return f"mlflow ui --backend-store-uri {self.backend_uri} --artifacts-destination {self.root / 'artifacts'}"

    def start(self) -> LocalMlflowServer:
        return self.launch().wait()

    def launch(self) -> LocalMlflowServer:
        """Start the server process and return at once (:meth:`wait` for it to answer)."""
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - lives as long as the server
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", self.backend_uri,
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", self.host, "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        # a session of its own, so stopping it stops gunicorn/uvicorn workers too and Ctrl-C on the sweep is ours
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._deadline = time.monotonic() + self.start_timeout_s
        return self

    def wait(self) -> LocalMlflowServer:
        """Block until the launched server answers its health check."""
        while time.monotonic() < self._deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"mlflow server did not answer on {self.uri} within {self.start_timeout_s:.0f} s")

    def _log_tail(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> LocalMlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
