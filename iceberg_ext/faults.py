"""Fault points that tests (and the consistency checker) trigger to crash a real process.

Set ``ICEBARRIER_FAULT`` to a point's name; the process then exits abruptly (os._exit, no
cleanup, like a kill -9) when it reaches that point. ``ICEBARRIER_FAULT_AFTER=N`` lets the
point pass N times first.
"""

from __future__ import annotations

import os

FAULT_ENV = "ICEBARRIER_FAULT"
FAULT_AFTER_ENV = "ICEBARRIER_FAULT_AFTER"
CRASH_EXIT_CODE = 137

AFTER_INPUT_RANGE = "after-input-range"
AFTER_ICEBERG_COMMIT = "after-iceberg-commit"
AFTER_CONTROL_PLANE = "after-control-plane"
IN_CATALOG_COMMIT = "in-catalog-commit"  # the REST catalog: pointers swapped, record not yet written
POINTS = (AFTER_INPUT_RANGE, AFTER_ICEBERG_COMMIT, AFTER_CONTROL_PLANE, IN_CATALOG_COMMIT)

_passed: dict[str, int] = {}


def point(name: str) -> None:
    """Crash here if the environment asks for it."""
    if os.environ.get(FAULT_ENV) != name:
        return
    _passed[name] = _passed.get(name, 0) + 1
    if _passed[name] > int(os.environ.get(FAULT_AFTER_ENV, "0")):
        os._exit(CRASH_EXIT_CODE)


# A deliberate bug a process is started with, for the checker's mutation tests (a checker must
# fail a run with it): ``ICEBARRIER_MUTATION=nonatomic-publish`` makes the catalog server publish
# a job session's staged commits one transaction at a time, the completion last;
# ``expire-protected`` makes expiry (the maintenance service's too) ignore the protected set;
# ``no-rebase`` makes the catalog server refuse a job's commit or publish that maintenance moved
# the table under (as before the commit was replayed over it: maintenance wins the race), the
# maintenance service compact under a staged session (waiting for one before it rewrites), and
# the server hold a publish until maintenance moved a staged sink (the race, made certain).
# ``kafka-uncommitted`` makes a Kafka source read its ranges read_uncommitted (aborted
# transactions' records enter the table: `check --kafka` must fail). ``plan-at-latest`` makes the
# catalog server plan every scan on the table's newest metadata, whatever the warehouse's cut.
MUTATION_ENV = "ICEBARRIER_MUTATION"
NONATOMIC_PUBLISH = "nonatomic-publish"
EXPIRE_PROTECTED = "expire-protected"
NO_REBASE = "no-rebase"
KAFKA_UNCOMMITTED = "kafka-uncommitted"
PLAN_AT_LATEST = "plan-at-latest"
MUTATIONS = (NONATOMIC_PUBLISH, EXPIRE_PROTECTED, NO_REBASE, KAFKA_UNCOMMITTED, PLAN_AT_LATEST)


def mutated(name: str) -> bool:
    return os.environ.get(MUTATION_ENV) == name
