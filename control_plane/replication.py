"""The control plane's standbys, as the DSN names them: how far each lags behind the primary
(DESIGN.md, "The control plane survives losing its primary").

A standby's lag is how long ago it replayed its last transaction while WAL it received waits to
be replayed: a promotion first replays what is waiting, so a standby lagging 30 s takes over 30 s
late. WAL received a moment ago is not lag: a standby that replays what it had received when
asked within :data:`SETTLE_S` lags only the time that took. Past ``ICEBARRIER_STANDBY_MAX_LAG``
(default 10s) it is refused in one line (`icebarrier db status`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from icebarrier.control_plane.db import duration_env_s, hosts_of
from icebarrier.control_plane.errors import ConfigurationError

MAX_LAG_ENV, DEFAULT_MAX_LAG = "ICEBARRIER_STANDBY_MAX_LAG", "10s"
SETTLE_S = 1.0  # WAL received this recently is being replayed, not waiting
_ASKED = (
    "SELECT pg_is_in_recovery() AS standby, pg_last_wal_receive_lsn() AS received, "
    "extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8 AS since_replay_s"
)
_REPLAYED = "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn"


@dataclass(frozen=True, slots=True)
class Standby:
    host: str
    port: int
    lag_s: float | None  # None: it replayed no transaction yet

    def to_json(self) -> dict:
        return {"host": self.host, "port": self.port, "lag_s": None if self.lag_s is None else round(self.lag_s, 3)}


def standbys(dsn: str) -> list[Standby]:
    """Each host of ``dsn`` that answers as a standby, with its lag (hosts that do not answer,
    and the primary, are left out)."""
    found = []
    for host, port in hosts_of(conninfo_to_dict(dsn)):
        one = make_conninfo(dsn, host=host, port=str(port), target_session_attrs="any", connect_timeout="3")
        try:
            with psycopg.connect(one, autocommit=True) as conn:
                standby, received, since_replay_s = conn.execute(_ASKED).fetchone()  # type: ignore[misc]
                if standby:
                    found.append(Standby(host, port, _lag_s(conn, received, since_replay_s)))
        except psycopg.Error:
            continue
    return found


def _lag_s(conn: psycopg.Connection, received: str | None, since_replay_s: float | None) -> float | None:
    """How long the standby takes to replay what it had received when asked (within
    :data:`SETTLE_S`), else how long ago it last replayed a transaction."""
    asked = time.monotonic()
    while received is not None and time.monotonic() - asked < SETTLE_S:
        if conn.execute(_REPLAYED, (received,)).fetchone()[0]:  # type: ignore[index]
            return time.monotonic() - asked
        time.sleep(0.02)
    return since_replay_s


def check_lag(found: list[Standby]) -> None:
    """Refuse, in one line, a standby lagging past the bound."""
    bound_s = duration_env_s(MAX_LAG_ENV, DEFAULT_MAX_LAG)
    for s in found:
        if s.lag_s is not None and s.lag_s > bound_s:
            raise ConfigurationError(
                f"the standby at {s.host}:{s.port} replays {s.lag_s:.1f} s behind the primary, past "
                f"{MAX_LAG_ENV}={bound_s:g}s: a promotion now would first wait for it; find what holds its "
                f"replay back (its disk, a paused replay, a long query) or raise the bound"
            )
