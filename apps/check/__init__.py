"""``icebarrier check``: a seeded, randomized consistency checker (in the spirit of Zippy).

Root and intermediate jobs and an expiry run as separate OS processes; jobs are killed at
random fault points, the control-plane Postgres (a private embedded instance) is restarted,
and readers query at every level, while the driver validates every barrier, every read and
every pin against a model that is a pure function of the seed. See :mod:`.driver`, and by
concern :mod:`.fault_plan`, :mod:`.reading`, :mod:`.audits`, :mod:`.report`.
"""

from icebarrier.apps.check.model import ACCOUNTS, OPENING, SCHEMAS, check_cut, compare, events, expected


def __getattr__(name: str):
    # The driver on first use: the job exec scripts import only the model (a second less per step).
    if name == "CheckReport":
        from icebarrier.apps.check.report import CheckReport

        return CheckReport
    if name == "fault_schedule":
        from icebarrier.apps.check.fault_plan import fault_schedule

        return fault_schedule
    if name in ("private_env", "run_check"):
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
