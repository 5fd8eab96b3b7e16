"""A Postgres primary and its synchronous standby on this machine: what production runs the
control plane on (RDS or Cloud SQL high availability, Patroni, a streaming replica), for the
failover tests and ``icebarrier check --failover``.

Two clusters of Debian's PostgreSQL binaries (the embedded ones when Debian's are missing), on
127.0.0.1 and free ports. The standby is a ``pg_basebackup -R -X stream`` of the primary and
streams from it as ``application_name=standby``; the primary waits for it at every commit
(``synchronous_standby_names = 'standby'``, ``synchronous_commit = on``: a commit is
acknowledged once its WAL is flushed on both, so a promoted standby holds every acknowledged
commit; ``remote_apply`` would also make it visible there at once, which only a reader of the
standby needs, and nothing here reads one).

:meth:`PostgresPair.fail_over` is what an HA manager does when the primary dies: promote the
standby, then clear the ``synchronous_standby_names`` it inherited from the base backup (with no
standby of its own, every commit on it would wait for one until then).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from icebarrier.apps.embedded import EmbeddedPostgresError, children, find_binaries, free_port, make_traversable, run_as

STANDBY_NAME = "standby"
STALL_S = 120.0  # a promotion that shows no progress this long has failed


def binaries() -> Path:
    """Debian's PostgreSQL binaries (the newest installed), else the embedded ones."""
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_basebackup"), key=lambda p: int(p.parts[-3]))
    return debian[-1].parent if debian else find_binaries()


def _os_user() -> str | None:
    """Who runs the servers: ourselves, or as root the OS user ``postgres`` (Debian's), else the
    embedded server's."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        return pwd.getpwnam("postgres").pw_name
    except KeyError:
        from icebarrier.apps.embedded import _os_user as embedded_user

        return embedded_user()[0]


@dataclass
class Node:
    name: str
    data_dir: Path
    port: int

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it runs (a killed one leaves its pid file behind)."""
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            return None
        return None if state in ("Z", "X") else pid  # a zombie: killed, and nobody reaped it (no init here)


@dataclass
class PostgresPair:
    """``primary`` and ``standby`` swap after :meth:`fail_over`; :meth:`dsn` names both, so that
    a client finds whichever is the primary now."""

    state_dir: Path
    primary: Node = field(init=False)
    standby: Node | None = field(init=False, default=None)
    nodes: list[Node] = field(init=False, default_factory=list)  # both, in the order clients try them
    _rebuilding: threading.Thread | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        self.bin = binaries()
        self.user = _os_user()

    # -- the clusters ----------------------------------------------------------------------------

    def start(self) -> PostgresPair:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.user:
            make_traversable(self.state_dir)
            make_traversable(self.bin)
        self.primary = Node("a", self.state_dir / "a", free_port())
        self._dir(self.primary.data_dir)
        self._run(
            "initdb", "-D", self.primary.data_dir, "-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-sync"
        )
        with open(self.primary.data_dir / "postgresql.conf", "a") as conf:
            conf.write(
                "wal_level = replica\nmax_wal_senders = 5\nmax_connections = 200\nsynchronous_commit = on\n"
                f"synchronous_standby_names = '{STANDBY_NAME}'\nwal_keep_size = '256MB'\n"
            )
        with open(self.primary.data_dir / "pg_hba.conf", "a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        self._start(self.primary)
        self.standby = Node("b", self.state_dir / "b", free_port())
        self.nodes = [self.primary, self.standby]
        self._clone(self.primary, self.standby)
        self.wait_streaming()
        return self

    def _clone(self, source: Node, node: Node) -> None:
        """``node`` as a streaming standby of ``source`` (a base backup, WAL streamed with it)."""
        self._dir(node.data_dir)
        self._run("pg_basebackup", "-D", node.data_dir, "-h", "127.0.0.1", "-p", source.port, "-U", "postgres",
                  "-R", "-X", "stream", "--checkpoint=fast", "--no-sync")  # fmt: skip
        # -R writes primary_conninfo into postgresql.auto.conf, which wins over postgresql.conf:
        # the standby's name goes there, or the primary never counts it as its synchronous standby.
        auto = node.data_dir / "postgresql.auto.conf"
        lines = [ln for ln in auto.read_text().splitlines() if not ln.startswith("primary_conninfo")]
        conninfo = f"host=127.0.0.1 port={source.port} user=postgres application_name={STANDBY_NAME}"
        auto.write_text("\n".join([*lines, f"primary_conninfo = '{conninfo}'", ""]))
        self._start(node)

    def wait_streaming(self, timeout_s: float = 60) -> None:
        """Until the primary counts the standby as its synchronous one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
                row = conn.execute(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s", (STANDBY_NAME,)
                ).fetchone()
            if row and row[0] == "sync":
                return
            time.sleep(0.1)
        raise EmbeddedPostgresError(f"the standby on port {self.standby and self.standby.port} never streamed")

    def _dir(self, path: Path) -> None:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(mode=0o700)
        if self.user:
            shutil.chown(path, self.user, self.user)

    def _start(self, node: Node) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {node.port} -c unix_socket_directories=''"
        self._run("pg_ctl", "-D", node.data_dir, "-l", node.data_dir / "server.log", "-w", "-t", "60",
                  "-o", options, "start")  # fmt: skip

    def _run(self, program: str, *args) -> None:
        run_as([str(self.bin / program), *map(str, args)], self.user)

    # -- what clients are given ------------------------------------------------------------------

    def dsn(self, dbname: str = "postgres") -> str:
        """Both nodes, the primary found by ``target_session_attrs=read-write`` (libpq tries them in turn)."""
        hosts = ",".join("127.0.0.1" for _ in self.nodes)
        ports = ",".join(str(n.port) for n in self.nodes)
        return (
            f"host={hosts} port={ports} user=postgres dbname={dbname} target_session_attrs=read-write connect_timeout=2"
        )

    # -- failing over ----------------------------------------------------------------------------

    def kill_primary(self) -> float:
        """SIGKILL the primary's postmaster and every backend (a lost machine); returns the time.monotonic() of death."""
        pid = self.primary.pid
        assert pid is not None, "the primary is not running"
        for p in [pid, *children(pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return time.monotonic()

    def promote(self) -> float:
        """Promote the standby and clear its inherited ``synchronous_standby_names`` (the HA
        manager's part); returns how long that took (s)."""
        assert self.standby is not None, "there is no standby to promote"
        started = time.monotonic()
        self._run("pg_ctl", "-D", self.standby.data_dir, "-W", "promote")  # signalled; its end waited for below
        self._wait_promoted(self.standby)
        self._name_synchronous_standby(self.standby, "")
        self.primary, self.standby = self.standby, None
        return time.monotonic() - started

    def _wait_promoted(self, node: Node) -> None:
        """Until ``node`` leaves recovery, however long a loaded machine takes: it fails only once
        the node stops making progress (its log, its replay position and its answers unchanged for
        :data:`STALL_S`) or its postmaster dies (``pg_ctl promote -t 60`` ran out of time on a
        machine busy with other work)."""
        log = node.data_dir / "server.log"
        seen, moved = None, time.monotonic()
        while True:
            if node.pid is None:
                raise EmbeddedPostgresError(f"the standby on port {node.port} died while promoted")
            try:
                with psycopg.connect(node.dsn(), autocommit=True, connect_timeout=5) as conn:
                    row = conn.execute("SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text").fetchone()
            except psycopg.OperationalError:
                row = None  # not answering this moment: no progress seen
            if row is not None and not row[0]:
                return
            mark = (row, log.stat().st_size if log.exists() else 0)
            if mark != seen:
                seen, moved = mark, time.monotonic()
            elif time.monotonic() - moved > STALL_S:
                raise EmbeddedPostgresError(
                    f"the standby on port {node.port} made no progress in its promotion for {STALL_S:g} s"
                )
            time.sleep(0.05)

    def rebuild_standby(self) -> None:
        """The node that died, cloned again from the primary and made its synchronous standby
        (what an HA manager does next: until then a second failover would lose commits)."""
        dead = next(n for n in self.nodes if n is not self.primary)
        if dead.pid is not None:
            self._run("pg_ctl", "-D", dead.data_dir, "-m", "immediate", "-w", "stop")
        self._clone(self.primary, dead)
        self._name_synchronous_standby(self.primary, STANDBY_NAME)
        self.standby = dead
        self.wait_streaming()

    @staticmethod
    def _name_synchronous_standby(node: Node, name: str) -> None:
        """Set ``synchronous_standby_names`` on ``node`` (``""``: commits wait for no standby)."""
        with psycopg.connect(node.dsn(), autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
            conn.execute("SELECT pg_reload_conf()")

    def replicate_synchronously(self, synchronous: bool) -> None:
        """Whether the primary waits for its standby at each commit (False: asynchronous
        replication, what Patroni falls back to with ``synchronous_mode_strict: false``)."""
        self._name_synchronous_standby(self.primary, STANDBY_NAME if synchronous else "")

    def cut_off_standby(self, timeout_s: float = 30) -> None:
        """The standby stops receiving WAL (a network partition between the two): its
        ``primary_conninfo`` cleared; returns once the primary no longer streams to it."""
        assert self.standby is not None, "there is no standby"
        with psycopg.connect(self.standby.dsn(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
            conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout_s
        while True:
            with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
                if not conn.execute("SELECT 1 FROM pg_stat_replication").fetchone():
                    return
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(f"the standby on port {self.standby.port} still streams")
            time.sleep(0.1)

    def restart(self, *, down_s: float = 0.0) -> str:
        """What ``icebarrier check --failover`` does where a run restarts its Postgres: the primary
        killed, ``down_s`` later the standby promoted (clients find it through :meth:`dsn`), then
        the dead node rebuilt as the new primary's standby, in the background (a failover that
        comes first waits for it, as an HA manager fails over only to a synchronous standby).
        Returns the DSN (unchanged)."""
        self.wait_rebuilt()
        self.kill_primary()
        time.sleep(down_s)
        self.promote()
        self._rebuilding = threading.Thread(target=self.rebuild_standby, name="pg-pair-rebuild", daemon=True)
        self._rebuilding.start()
        return self.dsn()

    def wait_rebuilt(self) -> None:
        if self._rebuilding is not None:
            self._rebuilding.join()
            self._rebuilding = None

    def fail_over(self) -> tuple[float, float]:
        """Kill the primary and promote the standby; (the moment of death, the promotion's seconds)."""
        died = self.kill_primary()
        return died, self.promote()

    def stop(self) -> None:
        self.wait_rebuilt()
        for node in [self.primary, *([self.standby] if self.standby else [])]:
            if node.pid is not None:
                try:
                    self._run("pg_ctl", "-D", node.data_dir, "-m", "immediate", "-w", "stop")
                except EmbeddedPostgresError:
                    pass
