"""The Spark line the suite does not run on, for its slice (the ``other_line`` marker): a virtual
environment that sees everything installed here (``--system-site-packages``) but holds the other
line's PySpark, made once under ``~/.cache/icebarrier/venvs/`` with pip, at the pin of the line's extra
in pyproject.toml (``spark35``: ``pyspark==3.5.*``), then run by ``tests/iceberg_ext/test_spark_lines.py``.
Only PySpark is in it: icebarrier and everything else come from the checkout installed here.

    python -m tests.other_line         # make it now (what .ci/run does before the tests)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from icebarrier.iceberg_ext import config, spark_lines
from icebarrier.iceberg_ext.errors import SparkUnavailableError

REPO = Path(__file__).resolve().parent.parent


def other() -> spark_lines.SparkLine:
    """The supported line that is not the installed PySpark's (the default's other line without one)."""
    try:
        here = spark_lines.installed()
    except SparkUnavailableError:
        here = spark_lines.DEFAULT
    return next(line for line in spark_lines.LINES.values() if line is not here)


def pyspark_pin(line: spark_lines.SparkLine) -> str:
    """The PySpark requirement of the extra ``line.install`` names, as pyproject.toml has it."""
    extra = line.install.split("[", 1)[1].split("]", 1)[0]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(r for r in extras[extra] if r.startswith("pyspark"))


def python(line: spark_lines.SparkLine | None = None) -> Path:
    """The interpreter of ``line``'s environment (the other line's), made once under a lock."""
    line = line or other()
    home = config.cache_dir("venvs")
    env = home / f"pyspark-{line.version}"
    made, script = env / ".complete", env / "bin" / "icebarrier"
    if made.is_file() and script.is_file():
        return env / "bin" / "python"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.is_file():
            shutil.rmtree(env, ignore_errors=True)
            venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env)
            subprocess.run(
                [env / "bin" / "python", "-m", "pip", "install", "-q", pyspark_pin(line)],
                check=True,
                env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
            )
            made.touch()
        if not script.is_file():  # also for an environment made before the script was
            _console_script(script)
    return env / "bin" / "python"


def _console_script(script: Path) -> None:
    """``icebarrier`` run by this environment's Python. Tests run it by name, the running Python's
    scripts first on PATH (tests/conftest.py); without it a shell found the one installed here,
    which runs on the suite's Spark line (the shopping walk-through failed so on 3.5)."""
    script.write_text(
        f"#!{script.parent / 'python'}\nimport sys\n\nfrom icebarrier.cli.main import main\n\nsys.exit(main())\n"
    )
    script.chmod(0o755)


if __name__ == "__main__":
    print(python(), file=sys.stderr)
