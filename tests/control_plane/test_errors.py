"""Every error survives pickling as itself (errors cross process boundaries: the checker's
processes, multiprocessing workers), and every SQLSTATE the functions raise maps to one."""

import json
import pickle

import pytest

from icebarrier.control_plane import errors, sqlstates
from icebarrier.iceberg_ext.errors import LeaseLostError, StatementNotPinnableError

SAMPLES = [
    errors.LockTimeoutError(
        "expiry of t", "1s", [{"pid": 7, "usename": "u", "application_name": "a", "state": "idle in transaction"}]
    ),
    errors.NoValidCutError(["lake.db.t"], "t completed no barrier yet", holding={"lake.db.t": "no barrier"}),
    errors.SinkAlreadyOwnedError("lake.db.t", "owner", "other"),
    errors.PermissionDeniedError("r", "complete", "j", "role r may not complete job j"),
    errors.PermissionDeniedError("r", "connect", None, "no access", fix="ask the admin"),
    errors.SchemaMigrationError("icebarrier", "permission denied"),
    errors.CompletionConflictError("j", 5, {"t": 1}, {"t": 2}),
    errors.InvalidValueError("bad"),
    LeaseLostError("lease-1", "no renewal"),
    StatementNotPinnableError("lake.db.t", "time travel"),
]


@pytest.mark.parametrize("error", SAMPLES, ids=lambda e: type(e).__name__)
def test_an_error_pickles_as_its_constructor_call(error):
    """Type, message and attributes come back unchanged, whatever the constructor takes."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)


def test_every_sqlstate_builds_an_icebarrier_error():
    """Each registered SQLSTATE turns a function's DETAIL into the error it names."""
    detail = {
        "job": "j",
        "barrier": 5,
        "table": "lake.db.t",
        "revision_id": 1,
        "tables": ["lake.db.t"],
        "watermarks": {"lake.db.t": 1},
        "recorded": {},
        "given": {},
        "expected": 6,
        "watermark": 4,
        "waiting": {"lake.db.t": None},
        "states": [{"name": "lake.db.t", "start": None, "watermark": None}],
        "snapshot_id": "9",
        "lease_id": "l",
        "state": "expired",
        "owner": "o",
        "path": ["a", "j", "a"],
        "role": "r",
        "action": "act",
        "what": "w",
        "timeout": "1s",
        "holders": [],
        "anchor": 5,
    }
    for code in sqlstates.SQLSTATES:
        error = sqlstates.from_sqlstate(code, "message from SQL", json.dumps(detail))
        assert isinstance(error, errors.IcebarrierError), code
    assert sqlstates.from_sqlstate("23505", "duplicate", None) is None
