"""The control plane's standbys, as the DSN names them: how far each lags behind the primary
(DESIGN.md, "The control plane survives losing its primary").

A standby's lag is how long ago it replayed its last transaction while WAL it received waits to
be replayed (0 when it has replayed all it received): a promotion first replays what is waiting,
so a standby lagging 30 s takes over 30 s late. Past ``ICEBARRIER_STANDBY_MAX_LAG`` (default
10s) it is refused in one line (`icebarrier db status`).
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from icebarrier.control_plane.db import duration_env_s, hosts_of
from icebarrier.control_plane.errors import ConfigurationError

MAX_LAG_ENV, DEFAULT_MAX_LAG = "ICEBARRIER_STANDBY_MAX_LAG", "10s"
_LAG = (
    "SELECT pg_is_in_recovery() AS standby, CASE WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() "
    "THEN 0 ELSE extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp()) END::float8 AS lag_s"
)


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
                standby, lag_s = conn.execute(_LAG).fetchone()  # type: ignore[misc]
        except psycopg.Error:
            continue
        if standby:
            found.append(Standby(host, port, lag_s))
    return found


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
