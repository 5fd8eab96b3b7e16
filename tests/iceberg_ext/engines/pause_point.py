"""The pause point the plain scripts beside it share (imported as a sibling module: the scripts
run as files, so their folder is on sys.path; they import nothing of icebarrier). The Spark
script keeps its own copy: its pause runs inside a UDF, in a Python worker that cannot import
this folder."""

import os
import time


def pause(point: str, pid: int | None = None) -> None:
    """At ``point`` (when ``ENGINE_PAUSE`` names it) write ``pid`` (default: this process's) to
    ``ENGINE_PAUSE_FILE`` and wait until the file is gone."""
    if os.environ.get("ENGINE_PAUSE") == point:
        with open(os.environ["ENGINE_PAUSE_FILE"], "w") as f:
            f.write(str(pid or os.getpid()))
        while os.path.exists(os.environ["ENGINE_PAUSE_FILE"]):
            time.sleep(0.05)
