"""The Spark line the suite does not run on, for its slice (the ``other_line`` marker): a virtual
environment that sees everything installed here (``--system-site-packages``) but holds the other
line's PySpark, made once under ``~/.cache/icebarrier/venvs/`` with pip as a user would pick a line
(``pip install -e '.[spark35]'``), then run by ``tests/iceberg_ext/test_spark_lines.py``.

    python -m tests.other_line         # make it now (what .ci/run does before the tests)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from icebarrier.iceberg_ext import spark_lines
from icebarrier.iceberg_ext.errors import SparkUnavailableError

REPO = Path(__file__).resolve().parent.parent


def other() -> spark_lines.SparkLine:
    """The supported line that is not the installed PySpark's (the default's other line without one)."""
    try:
        here = spark_lines.installed()
    except SparkUnavailableError:
        here = spark_lines.DEFAULT
    return next(line for line in spark_lines.LINES.values() if line is not here)


def python(line: spark_lines.SparkLine | None = None) -> Path:
    """The interpreter of ``line``'s environment (the other line's), made once under a lock."""
    line = line or other()
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "icebarrier" / "venvs"
    env = home / f"pyspark-{line.version}"
    made = env / ".complete"
    if made.is_file():
        return env / "bin" / "python"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.is_file():
            shutil.rmtree(env, ignore_errors=True)
            venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env)
            extra = line.install.split("[", 1)[1].split("]", 1)[0]  # the extra `line.install` names
            subprocess.run(
                [env / "bin" / "python", "-m", "pip", "install", "-q", "-e", f"{REPO}[{extra}]"],
                check=True,
                env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
            )
            made.touch()
    return env / "bin" / "python"


if __name__ == "__main__":
    print(python(), file=sys.stderr)
