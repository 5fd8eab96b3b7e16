"""``icebarrier run FILE.py...``: run jobs defined with the icebarrier runtime."""

from __future__ import annotations

import json
import runpy
import sys

import click

from icebarrier.cli.render import emit
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import parse_duration_s


def load_job(path: str):
    """The Job a file defines: its variable ``job``, or its only Job instance."""
    from icebarrier.iceberg_ext.job import Job

    try:
        namespace = runpy.run_path(path, run_name="icebarrier_job")
    except SyntaxError as exc:
        raise IcebarrierError(f"{path}, line {exc.lineno}: {exc.msg}; fix the job file") from exc
    except IcebarrierError:
        raise
    except Exception as exc:  # the job file's own code failed
        raise IcebarrierError(
            f"{path} failed while loading: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"
        ) from exc
    if isinstance(namespace.get("job"), Job):
        return namespace["job"]
    found = [v for v in namespace.values() if isinstance(v, Job)]
    if len(found) != 1:
        raise IcebarrierError(f"{path} defines {len(found)} jobs; define exactly one, or name the one to run `job`")
    return found[0]


@click.command("run")
@click.argument("paths", metavar="FILE.py...", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--once",
    "mode",
    flag_value="once",
    default=True,
    help="Complete every ready barrier, then exit. With several files: each in turn, in the order "
    "given (upstream first), in one process and one Spark session.",
)
@click.option("--follow", "mode", flag_value="follow", help="Keep going until SIGINT/SIGTERM.")
@click.option(
    "--on-request",
    "mode",
    flag_value="on-request",
    help="Stay up, Spark warm: run once per line read on stdin, answering each on stdout; exit at its end "
    "(how `icebarrier schedule` runs job files).",
)
@click.option(
    "--poll",
    default="60s",
    show_default=True,
    help="--follow waits for notices from the control plane; this is how often it looks anyway.",
)
@click.pass_obj
def run(obj, paths: tuple[str, ...], mode: str, poll: str) -> None:
    """Run the job FILE.py defines (register, complete barriers in order, heartbeat, stop cleanly).
    Several files run --once one after the other, sharing one Spark session (one JVM start)."""
    from icebarrier.iceberg_ext.runtime import ANSWER, Runtime

    if len(paths) > 1 and mode != "once":
        raise click.UsageError(f"several job files run only with --once; run each --{mode} in a process of its own")
    loaded = [load_job(path) for path in paths]  # a bad file fails before any job runs
    summaries = []
    for job in loaded:
        with Runtime(job, settings=obj.settings()) as runtime:  # later ones reuse the Spark session
            if mode == "on-request":
                runtime.on_request(sys.stdin, lambda answer: click.echo(ANSWER + json.dumps(answer)))
                return
            summaries.append(runtime.run(follow=mode == "follow", poll_s=parse_duration_s(poll)))
    results = [{"job": s.job, "completed": s.completed, "stopped_by_signal": s.stopped_by_signal} for s in summaries]
    emit(
        obj,
        results[0] if len(results) == 1 else results,
        "\n".join(f"job {s.job}: completed {len(s.completed)} barrier(s)" for s in summaries),
    )


COMMANDS = [run]
