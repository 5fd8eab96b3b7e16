"""The checker's `icebarrier job exec` jobs, and the catalog server they go through.

Two of the model's jobs run as plain PyIceberg scripts (no icebarrier API: the catalog
configuration `job exec` puts in their environment, and the model's pure functions) under
``icebarrier job exec --follow``, through an ``icebarrier serve`` the run starts: the root
``orders_in`` and the intermediate ``balances_job``. The fault schedule kills ``job exec``
(-9: its script lives on, fenced out of the next run's session), the script alone, and the
catalog server (restarted a moment later).

``job exec`` runs :mod:`.exec_script`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from icebarrier.apps.embedded import CLI, free_port
from icebarrier.iceberg_ext.faults import MUTATION_ENV

EXEC_JOBS = {"orders_in": "root", "balances_job": "derived"}
HOLD = "3s"  # a killed job exec's session is taken over this soon
QUIET_S = 1.0  # the server's --session-quiet: a read-committed session keeps its cut while loads come faster
SCRIPT = "icebarrier.apps.check.exec_script"


class CatalogServer:
    """An ``icebarrier serve`` process of the run (the same port across restarts)."""

    def __init__(self, env, home: Path, *, mutation: str | None = None) -> None:
        self.env, self.port, self.mutation = env, free_port(), mutation
        self.uri = f"http://127.0.0.1:{self.port}"
        self.config = home / "catalog.toml"
        storage = "".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in env.storage.items())
        self.config.write_text(f"[storage]\n{storage}" if storage else "")
        self.log = open(home / "catalog-server.log", "a")
        self.proc: subprocess.Popen | None = None
        self.down_until: float | None = None

    def start(self, timeout_s: float = 60) -> None:
        environ = {
            **os.environ,
            "ICEBARRIER_DSN": self.env.dsn,
            "ICEBARRIER_SCHEMA": self.env.schema,
            "ICEBARRIER_WAREHOUSE": self.env.warehouse,
            "ICEBARRIER_CONFIG": str(self.config),
        }
        environ.pop(MUTATION_ENV, None)
        if self.mutation:
            environ[MUTATION_ENV] = self.mutation
        self.proc = subprocess.Popen(
            [*CLI, "serve", "--port", str(self.port), "--session-quiet", f"{QUIET_S:g}s"],
            env=environ,
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                self.down_until = None
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the checker's catalog server did not start; see {self.log.name}") from None
                time.sleep(0.05)

    def kill(self, down_s: float) -> None:
        """SIGKILL; :meth:`tend` starts it again ``down_s`` later."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.down_until = time.monotonic() + down_s

    def tend(self) -> None:
        if self.down_until is not None and time.monotonic() >= self.down_until:
            self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def exec_command(
    job: str, *, uri: str, credential: str, namespace: str, seed: int, barriers_file: Path, follow: bool
) -> list[str]:
    kind = EXEC_JOBS[job]
    options = ["--no-skip"] if kind == "root" else []  # a root's input changes with every barrier
    return [
        *CLI,
        "--output",
        "json",
        "job",
        "exec",
        job,
        "--follow" if follow else "--once",
        "--catalog-uri",
        uri,
        "--credential",
        credential,
        "--hold",
        HOLD,
        "--poll",
        "2s",
        *options,
        "--",
        sys.executable,
        "-m",
        SCRIPT,
        kind,
        namespace,
        str(seed),
        str(barriers_file),
    ]


def children(pid: int) -> list[int]:
    """The process's child processes (Linux)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
