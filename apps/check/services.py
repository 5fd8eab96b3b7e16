"""The checker's services: an ``icebarrier serve`` (for the job exec jobs) and, with
``--maintain``, the maintenance service; each an ``icebarrier`` process of the run that the
fault schedule kills (-9) or stops (SIGTERM: the server drains) and :meth:`Service.tend` starts
again ``down_s`` after it is gone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from icebarrier.apps.check.exec_jobs import QUIET_S
from icebarrier.apps.embedded import CLI, free_port
from icebarrier.control_plane import upkeep
from icebarrier.control_plane.fences import TTL_ENV
from icebarrier.iceberg_ext.faults import MUTATION_ENV


class Service:
    """An ``icebarrier`` command of the run, with the run's control plane, warehouse and
    storage, and the run's deliberate bug (``mutation``) if it has one; its output goes to
    ``<name>.log`` in the run's folder."""

    name = "service"
    stop_grace_s = 30.0  # at the run's end, from SIGTERM to SIGKILL

    def __init__(self, env, home: Path, *, mutation: str | None = None) -> None:
        self.env, self.mutation = env, mutation
        self.config = home / f"{self.name}.toml"
        self.config.write_text(
            "".join(
                f"[{section}]\n" + "".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in values.items())
                for section, values in (("storage", env.storage), ("storage.readers", env.readers))
                if values
            )
        )
        self.log_path = home / f"{self.name}.log"
        self.log = open(self.log_path, "a")  # noqa: SIM115 - closed by stop()
        self.proc: subprocess.Popen | None = None
        self.down_until: float | None = None
        self.stopping: tuple[float, float] | None = None  # SIGTERM sent: (when, down_s after it exits)
        self.stop_s: list[float] = []  # from each SIGTERM to the process's exit

    def args(self) -> list[str]:
        raise NotImplementedError

    def environ(self) -> dict[str, str]:
        return {
            **{k: v for k, v in os.environ.items() if k != MUTATION_ENV},
            "ICEBARRIER_DSN": self.env.dsn,
            "ICEBARRIER_SCHEMA": self.env.schema,
            "ICEBARRIER_WAREHOUSE": self.env.warehouse,
            "ICEBARRIER_CONFIG": str(self.config),
            **({MUTATION_ENV: self.mutation} if self.mutation else {}),
        }

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*CLI, *self.args()],
            env=self.environ(),
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,  # a kill takes what it started (a Spark JVM) with it
        )
        self.down_until = None

    def kill(self, down_s: float) -> None:
        """SIGKILL (its process group); :meth:`tend` starts it again ``down_s`` later."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stopping, self.down_until = None, time.monotonic() + down_s

    def terminate(self, down_s: float) -> bool:
        """SIGTERM (the process alone: it stops the way an operator's restart stops it);
        :meth:`tend` starts it again ``down_s`` after it exits. False: it was not running (a
        fault before this one has it down), nothing sent."""
        if self.proc is None or self.proc.poll() is not None or self.stopping is not None:
            return False
        self.proc.send_signal(signal.SIGTERM)
        self.stopping = (time.monotonic(), down_s)
        return True

    def tend(self) -> None:
        if self.stopping is not None and self.proc is not None and self.proc.poll() is not None:
            sent, down_s = self.stopping
            self.stop_s.append(time.monotonic() - sent)
            self.stopping, self.down_until = None, time.monotonic() + down_s
        if self.down_until is not None and time.monotonic() >= self.down_until:
            self.start()

    def restarted(self) -> None:
        """Running again now if a fault has it down or stopping."""
        if self.stopping is not None and self.proc is not None:
            self.proc.wait()
            self.tend()  # records how long it took to stop
        if self.down_until is not None:
            self.start()

    def tail(self, lines: int = 8) -> str:
        """Its log's last lines, joined with " | " (for a one-line violation; read after :meth:`stop`)."""
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class CatalogServer(Service):
    """An ``icebarrier serve`` process of the run (the same port across restarts)."""

    name = "catalog-server"

    def __init__(self, env, home: Path, *, mutation: str | None = None) -> None:
        super().__init__(env, home, mutation=mutation)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        return ["serve", "--port", str(self.port), "--session-quiet", f"{QUIET_S:g}s"]

    def cut_off(self) -> int:
        """How many times a SIGTERM's grace ran out with requests still in flight (uvicorn then
        cancels them: their clients get no answer). A long poll must end at SIGTERM, not hold it."""
        return self.log_path.read_text(errors="replace").count("timeout graceful shutdown exceeded")

    def start(self, timeout_s: float = 60) -> None:
        super().start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                assert self.proc is not None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the checker's catalog server did not start; see {self.log.name}") from None
                time.sleep(0.05)


# The checker's policies: everything as soon as it may (the protected set decides what stays).
AGGRESSIVE = {
    "retain_s": 0,
    "retain_last": 1,
    "compact_min_files": 2,
    "max_manifests": 2,
    "orphan_grace_s": 60,
    "metadata_grace_s": upkeep.COMMIT_RETRY_S,  # the least
}


class Maintenance(Service):
    """``icebarrier maintain`` looking every 0.2 s, on the run's tables with :data:`AGGRESSIVE`
    policies."""

    name = "maintain"
    stop_grace_s = 5.0  # the action in flight may be one a mutation holds open: the run is over

    def args(self) -> list[str]:
        return ["maintain", "--every", "0.2s"]

    def environ(self) -> dict[str, str]:
        # A lease to match its looks: a service killed by the run is taken over within 2 s (the
        # default 10 s would leave a short run with little maintenance).
        return {**super().environ(), TTL_ENV: "2s"}

    def configure(self, conn, tables) -> None:
        for table in tables:
            upkeep.set_policy(conn, table, AGGRESSIVE)

    def actions(self, conn) -> dict[str, int]:
        """``action result`` -> how many, over the run's tables."""
        counts: dict[str, int] = {}
        for status in upkeep.statuses(conn):
            for action, result, n in upkeep.counts(status.actions):
                if n:
                    key = f"{action} {result.replace('-', ' ')}"
                    counts[key] = counts.get(key, 0) + n
        return counts
