"""Control-plane settings: the ``setting`` table, durations stored in milliseconds.

Each stored value is checked by the table's constraint, so no client ever reads one it cannot
parse; writing goes through the ``set_setting`` function (the admin only).
"""

from __future__ import annotations

from icebarrier.control_plane.db import Conn, call, one


def get_s(conn: Conn, key: str) -> float:
    """A duration setting, in seconds."""
    return int(one(conn.execute("SELECT value FROM settings WHERE key = %s", (key,)))["value"]) / 1000


def set_s(conn: Conn, key: str, seconds: float) -> float:
    """Store a duration setting (rounded to milliseconds); returns what is stored, in seconds."""
    with conn.transaction():
        call(conn, "set_setting", key, str(round(seconds * 1000)))
    return get_s(conn, key)
