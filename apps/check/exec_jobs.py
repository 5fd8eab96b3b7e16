"""The checker's `icebarrier job exec` jobs, and the catalog server they go through.

Two of the model's jobs run as plain PyIceberg scripts (no icebarrier API: the catalog
configuration `job exec` puts in their environment, and the model's pure functions) under
``icebarrier job exec --follow``, through an ``icebarrier serve`` the run starts: the root
``orders_in`` and the intermediate ``balances_job``. The fault schedule kills ``job exec``
(-9: its script lives on, fenced out of the next run's session), the script alone, and the
catalog server (restarted a moment later).

``job exec`` runs :mod:`.exec_script`; the server is :class:`.services.CatalogServer`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from icebarrier.apps.embedded import CLI

EXEC_JOBS = {"orders_in": "root", "balances_job": "derived"}
HOLD = "3s"  # a killed job exec's session is taken over this soon
QUIET_S = 1.0  # the server's --session-quiet: a read-committed session keeps its cut while loads come faster
SCRIPT = "icebarrier.apps.check.exec_script"


def exec_command(
    job: str, *, uri: str, credential: str, namespace: str, seed: int, barriers_file: Path, follow: bool
) -> list[str]:
    kind = EXEC_JOBS[job]
    options = ["--no-skip"] if kind == "root" else []  # a root's input changes with every barrier
    return [
        *CLI,
        "--output",
        "json",
        "job",
        "exec",
        job,
        "--follow" if follow else "--once",
        "--catalog-uri",
        uri,
        "--credential",
        credential,
        "--hold",
        HOLD,
        "--poll",
        "2s",
        *options,
        "--",
        sys.executable,
        "-m",
        SCRIPT,
        kind,
        namespace,
        str(seed),
        str(barriers_file),
    ]
