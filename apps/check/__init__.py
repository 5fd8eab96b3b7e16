"""``icebarrier check``: a seeded, randomized consistency checker (in the spirit of Zippy).

Root and intermediate jobs and an expiry run as separate OS processes; jobs are killed at
random fault points, the control-plane Postgres (a private embedded instance) is restarted,
and readers query at every level, while the driver validates every barrier, every read and
every pin against a model that is a pure function of the seed. See :mod:`.driver`.
"""

from icebarrier.apps.check.model import ACCOUNTS, OPENING, SCHEMAS, check_cut, compare, events, expected


def __getattr__(name: str):
    # The driver on first use: the job exec scripts import only the model (a second less per step).
    if name in ("CheckReport", "fault_schedule", "private_env", "run_check"):
        from icebarrier.apps.check import driver

        return getattr(driver, name)
    if name == "Env":
        from icebarrier.apps.check.processes import Env

        return Env
    raise AttributeError(name)


__all__ = [
    "ACCOUNTS",
    "OPENING",
    "SCHEMAS",
    "CheckReport",
    "Env",
    "check_cut",
    "compare",
    "events",
    "expected",
    "fault_schedule",
    "private_env",
    "run_check",
]
