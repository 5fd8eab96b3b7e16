"""The suite's own harness: the xdist groups tests/conftest.py relies on hold.

Two embedded Postgres servers, or two Spark standalone clusters, must not start at once; the
suite keeps them apart with xdist groups (``--dist loadgroup``), some named on the tests, some
added by tests/conftest.py's collection hook. Both kinds failed silently once: the hook ran after
xdist had read the groups, and pytest 9.2 keeps node ids where xdist 3.8 cannot add a group to
them (pytest-dev/pytest-xdist#1386). Nothing failed; the tests just ran side by side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

GROUPED = """
import os, time
import pytest

def _ran(name):
    with open(os.path.join(os.environ["RAN_DIR"], name), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("i", range(6))
@pytest.mark.xdist_group("named")
def test_named(i):
    time.sleep(0.3)
    _ran(f"named-{i}")

@pytest.mark.parametrize("i", range(6))
@pytest.mark.cluster
def test_added(i):
    time.sleep(0.3)
    _ran(f"added-{i}")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.3)
"""


def test_xdist_groups_named_on_tests_and_added_by_the_conftest_hook_each_run_on_one_worker(tmp_path):
    """A group named on the tests, and one the conftest hook adds (the ``cluster`` tests'),
    each run on one worker of two, with the suite's own hook and the installed pytest and xdist."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    ran = tmp_path / "ran"
    ran.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAN_DIR": str(ran)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
        + ["-o", "markers=cluster", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = {f.name: f.read_text() for f in ran.iterdir()}
    for group in ("named", "added"):
        seen = {w for name, w in workers.items() if name.startswith(f"{group}-")}
        assert len([n for n in workers if n.startswith(f"{group}-")]) == 6
        assert len(seen) == 1, f"group {group!r} ran on workers {sorted(seen)}"
