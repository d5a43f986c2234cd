"""The local MLflow tracking server a sweep starts when it is given none: ``mlflow server`` on the loopback
interface, backed by SQLite and an artifact folder in the sweep's output.

Only the driver (and the report command) import this module; trial processes log through :mod:`gx_ray.tracking`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PID_FILE = "server.json"
"""In the store's folder while its server runs: a driver killed with SIGKILL cannot stop its server (a process
session of its own), so the next server of the same store finds the leftover here and stops it."""
WAIT_GRACE_S = 60.0


def empty_store() -> Path:
    """A new SQLite store as this MLflow version's server leaves it once it has created its tables (the Default
    experiment and workspace only): a new sweep's server starts from a copy instead of creating its tables through
    MLflow's ~60 schema migrations (5-7 s on 2 loaded cores, 0.1 s on the copy). Kept in ``$XDG_CACHE_HOME/gx-ray``
    by MLflow version; the first server of a version writes it."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "gx-ray" / "mlflow" / f"empty-{importlib.metadata.version('mlflow')}.db"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalMlflowServer:
    """``mlflow server`` on the loopback interface, backed by SQLite and an artifact folder under ``root``."""

    def __init__(
        self,
        root: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout_s: float = 180.0,
        backend_store_uri: str | None = None,
    ):
        """``backend_store_uri``: a database for a team server (``postgresql://user@host/db``); default SQLite in
        ``root``. Artifacts always go to ``root/artifacts``, served through the server."""
        self.root, self.host, self.port = Path(root).resolve(), host, port or free_port(host)
        self._backend_store_uri = backend_store_uri
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._keep_empty = False  # this server creates a new SQLite store: a copy is kept once its tables are made

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def backend_uri(self) -> str:
        return self._backend_store_uri or f"sqlite:///{self.root / 'mlflow.db'}"

    def ui_command(self, port: int) -> str:
        """What a user runs later to browse the runs without the sweep (on a port free now: another sweep's server
        or a second UI may hold the usual 5000)."""
        return (
            f"mlflow ui --backend-store-uri {self.backend_uri} --artifacts-destination {self.root / 'artifacts'} "
            f"--port {port}"
        )

    def start(self) -> LocalMlflowServer:
        return self.launch().wait()

    def launch(self) -> LocalMlflowServer:
        """Start the server process and return at once (:meth:`wait` for it to answer)."""
        self.root.mkdir(parents=True, exist_ok=True)
        stop_leftover(self.root)
        store, empty = self.root / "mlflow.db", empty_store()
        if self._backend_store_uri is None and not store.exists():
            if empty.is_file():
                shutil.copyfile(empty, store)
            else:
                self._keep_empty = True
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - lives as long as the server
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", self.backend_uri,
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", self.host, "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        if not self.host.startswith("127.") and self.host != "localhost":  # clients name it by this address
            command += ["--allowed-hosts", f"{self.host},{self.host}:{self.port},localhost:*,127.0.0.1:*"]
        # no GenAI job runner: seven more processes (huey consumers) that a sweep never uses
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        # a session of its own, so stopping it stops its uvicorn worker too and Ctrl-C on the sweep is ours
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        record = {"pid": self.process.pid, "port": self.port, "store": self.backend_uri}
        (self.root / PID_FILE).write_text(json.dumps(record) + "\n", encoding="utf-8")
        self._deadline = time.monotonic() + self.start_timeout_s
        return self

    def keep_alive(self, interval_s: float = 1.0) -> LocalMlflowServer:
        """Restart the server on the same port and store should it die while the sweep runs: the trials' clients
        retry (a bounded wait: :data:`gx_ray.runtime.MLFLOW_RETRIES`) and carry on against the new one."""

        def watch() -> None:
            while not self._stopping.wait(interval_s):
                if self.process is not None and self.process.poll() is not None and not self._stopping.is_set():
                    code = self.process.returncode
                    with contextlib.suppress(ProcessLookupError):  # the rest of its group: a worker holding the port
                        os.killpg(self.process.pid, signal.SIGKILL)
                    print(f"the MLflow server exited ({code}); starting it again on {self.uri}", file=sys.stderr)
                    try:
                        self.launch().wait()
                    except (OSError, RuntimeError, TimeoutError) as err:
                        print(f"the MLflow server did not come back: {err}", file=sys.stderr)

        threading.Thread(target=watch, name="mlflow-keep-alive", daemon=True).start()
        return self

    def wait(self) -> LocalMlflowServer:
        """Block until the server answers its health check: within ``start_timeout_s`` of its launch, and never less
        than :data:`WAIT_GRACE_S` from now (a wait that begins after a long preparation still asks)."""
        deadline = max(self._deadline, time.monotonic() + WAIT_GRACE_S)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        self._save_empty_store()
                        return self
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"mlflow server did not answer on {self.uri} within {self.start_timeout_s:.0f} s")

    def _save_empty_store(self) -> None:
        """The store as the server made it, before anyone has used it, kept as :func:`empty_store` (SQLite's backup:
        a consistent copy of an open database). Not kept: nothing lost but the next server's seconds."""
        if not self._keep_empty:
            return
        self._keep_empty = False
        empty = empty_store()
        partial = empty.with_name(f"{empty.name}.{os.getpid()}")
        try:
            empty.parent.mkdir(parents=True, exist_ok=True)
            with (contextlib.closing(sqlite3.connect(self.root / "mlflow.db")) as source,
                  contextlib.closing(sqlite3.connect(partial)) as copy):  # fmt: skip
                source.backup(copy)
            os.replace(partial, empty)  # whole or not at all, should two sweeps write it at once
        except (OSError, sqlite3.Error):
            partial.unlink(missing_ok=True)

    def _log_tail(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        self._stopping.set()
        if self.process is not None and self.process.poll() is None:
            _stop_group(self.process.pid, self.process.wait)
        (self.root / PID_FILE).unlink(missing_ok=True)

    def __enter__(self) -> LocalMlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_group(pid: int, wait: object, timeout_s: float = 20.0) -> None:
    """SIGTERM to the server's process group, SIGKILL if it has not ended after ``timeout_s``."""
    try:
        os.killpg(pid, signal.SIGTERM)
        wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(pid, signal.SIGKILL)
        wait(timeout=timeout_s)
    except ProcessLookupError:
        pass


def stop_leftover(root: Path) -> int | None:
    """Stop the server a killed driver left running on the store under ``root`` (its pid, if one was stopped)."""
    record_path = Path(root) / PID_FILE
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        pid = int(record["pid"])
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError, KeyError):  # no record, or its process is gone
        record_path.unlink(missing_ok=True)
        return None
    if "mlflow" not in command or str(Path(root).resolve()) not in command:  # the pid now belongs to another program
        record_path.unlink(missing_ok=True)
        return None

    def wait(timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            raise subprocess.TimeoutExpired(command, timeout)

    print(f"stopping the MLflow server (pid {pid}) a killed sweep left running on {root}", file=sys.stderr)
    _stop_group(pid, wait)
    record_path.unlink(missing_ok=True)
    return pid
