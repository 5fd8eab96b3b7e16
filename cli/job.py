"""``icebarrier job``: register jobs, ask for their next barrier, complete barriers, run any command as
a job through the catalog (``job exec``)."""

from __future__ import annotations

import sys

import click

from icebarrier.apps.catalog.clients import CA_CERT_ENV
from icebarrier.cli.render import BARRIER, barrier_label, emit, page, paging, table
from icebarrier.control_plane import jobs, targets
from icebarrier.control_plane.errors import InvalidValueError
from icebarrier.control_plane.model import (
    JobDefinition,
    TableName,
    parse_duration_s,
    parse_external_input,
    parse_job_name,
)


@click.group("job")
def job_group() -> None:
    """Register ETL jobs (sources -> sinks) and drive their barriers."""


@job_group.command("register")
@click.argument("name")
@click.option("--source", "sources", multiple=True, metavar="TABLE", help="Managed table the job reads (repeatable).")
@click.option("--sink", "sinks", multiple=True, metavar="TABLE", help="Managed table the job writes (repeatable).")
@click.option(
    "--external", "externals", multiple=True, metavar="NAME", help="External input of a root job (repeatable)."
)
@click.option("--replace", is_flag=True, help="Replace a registered job's definition.")
@click.option(
    "--command",
    "command",
    metavar="'CMD'",
    help="How `icebarrier schedule` runs the job: this shell command, under `job exec --once`.",
)
@click.option(
    "--file",
    "file",
    metavar="JOB.py",
    type=click.Path(exists=True, dir_okay=False, resolve_path=True),
    help="How `icebarrier schedule` runs the job: this PySpark job file, under `icebarrier run --once`.",
)
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Environment of the job's runs (repeatable).")
@click.option("--target-lag", metavar="DURATION", help="Target lag of each of the job's sinks (e.g. 5m).")
@click.pass_obj
def register(obj, name: str, sources, sinks, externals, replace: bool, command, file, env, target_lag) -> None:
    """Register job NAME. Refused, writing nothing: a second writer of a table, a cycle,
    a job reading its own sink, invalid names. The same definition again is a no-op.
    With --command or --file (and --env) it can run itself under `icebarrier schedule`;
    --target-lag sets its sinks' targets (`icebarrier table target-lag`)."""
    definition = JobDefinition(
        name=parse_job_name(name),
        sources=frozenset(TableName.parse(t) for t in sources),
        sinks=frozenset(TableName.parse(t) for t in sinks),
        external_inputs=frozenset(parse_external_input(e) for e in externals),
    )
    runner = _runner(command, file, env)
    lag_s = parse_duration_s(target_lag) if target_lag is not None else None
    conn = obj.conn()
    with conn.transaction():
        result = jobs.register(conn, definition, replace=replace)
        if runner is not None:
            targets.set_runner(conn, name, runner)
        if lag_s is not None:
            for sink in sorted(definition.sinks, key=str):
                targets.set_target_lag(conn, sink, lag_s)
    payload = {**result.to_json(), "runner": runner.to_json() if runner else None, "target_lag_s": lag_s}
    emit(obj, payload, f"job {name}: {result.status}")


def _runner(command: str | None, file: str | None, env) -> targets.Runner | None:
    if command is not None and file is not None:
        raise click.UsageError("give --command or --file, not both: a job runs one way")
    pairs = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.UsageError(f"--env {item!r} is not KEY=VALUE; e.g. --env SPARK_HOME=/opt/spark")
        pairs[key] = value
    if command is None and file is None:
        if pairs:
            raise click.UsageError("--env needs --command or --file: it is the environment of the job's runs")
        return None
    return targets.Runner(kind="command" if command is not None else "file", spec=command or file, env=pairs)


@job_group.command("unregister")
@click.argument("name")
@click.pass_obj
def unregister(obj, name: str) -> None:
    """Remove job NAME from the topology (its tables and their history stay)."""
    definition = jobs.unregister(obj.conn(), name)
    emit(obj, {"job": name, "status": "unregistered", **jobs.definition_json(definition)}, f"job {name}: unregistered")


@job_group.command("list")
@paging
@click.pass_obj
def list_(obj, limit: int, after: str | None, everything: bool) -> None:
    """List jobs with their kind, progress and lag (barriers behind), by name, a page at a time."""
    limit_ = None if everything else limit
    items = page(
        jobs.list_jobs(obj.conn(), after=after, limit=None if limit_ is None else limit_ + 1),
        limit=limit_,
        name=lambda i: i.definition.name,
        what="jobs",
        command="job list",
    )
    emit(
        obj,
        [i.to_json() for i in items],
        lambda: table(
            ["job", "kind", "status", "reads", "writes", "progress", "behind", "waiting for"],
            [
                (
                    i.definition.name,
                    i.kind,
                    i.status,
                    ", ".join(sorted(i.definition.external_inputs) or sorted(map(str, i.definition.sources))),
                    ", ".join(sorted(map(str, i.definition.sinks))),
                    barrier_label(i.progress),
                    i.barriers_behind,
                    i.waiting_for or "-",
                )
                for i in items
            ],
            empty="no jobs registered; see `icebarrier job register --help`",
        ),
    )


@job_group.command("show")
@click.argument("name")
@click.pass_obj
def show(obj, name: str) -> None:
    """Show job NAME: definition, progress and the state of its tables."""
    info = jobs.show(obj.conn(), name)

    def text() -> str:
        d = info.definition
        lines = [
            f"job:        {d.name} ({info.kind})",
            f"registered: {info.registered_at.isoformat()}",
            f"status:     {info.status}"
            + (f" (heartbeat {info.heartbeat_at.isoformat()})" if info.heartbeat_at else ""),
            f"progress:   {barrier_label(info.progress)} ({info.barriers_behind} barriers behind)",
        ]
        if info.waiting_for:
            lines.append(f"waiting for: {info.waiting_for}")
        c = info.computation
        if c is not None:
            how = "incremental" if c["incremental"] else f"full: {c['reason']}"
            lines.append(
                f"computed:   barrier {barrier_label(c['barrier'])} {how} "
                f"({c['incremental_total']} incremental, {c['full_total']} full so far)"
            )
        if d.external_inputs:
            lines.append(f"external:   {', '.join(sorted(d.external_inputs))}")
        lines.append("")
        rows = [("source", str(s.name), s.start_barrier, s.watermark) for s in info.sources]
        rows += [("sink", str(s.name), s.start_barrier, s.watermark) for s in info.sinks]
        lines.append(table(["role", "table", "start", "watermark"], rows))
        return "\n".join(lines)

    emit(obj, info.to_json(), text)


@job_group.command("ranges")
@click.argument("name")
@click.option("--limit", type=click.IntRange(1, 10_000), default=10, show_default=True, help="Ranges to list.")
@click.pass_obj
def ranges(obj, name: str, limit: int) -> None:
    """The input ranges root job NAME recorded, newest first: what each barrier read (a Kafka
    topic's offsets per partition, a file list, a key interval, a micro-batch); a replay of the
    barrier reads exactly that again."""
    from itertools import islice

    from icebarrier.control_plane import runs
    from icebarrier.iceberg_ext.kafka import encode_offsets, offsets_of

    conn = obj.conn()
    jobs.show(conn, name)  # a job that does not exist is refused by name
    recorded = list(islice(runs.recent_ranges(conn, name, before_barrier=2**63 - 1), limit))

    def described(spec: dict) -> str:
        if "offsets" in spec:
            return f"{spec.get('topic', '?')} {encode_offsets(offsets_of(spec))}" + (
                f" (micro-batch {spec['batch_id']})" if "batch_id" in spec else ""
            )
        return ", ".join(f"{k}={v}" for k, v in spec.items() if k != "barrier")

    def text() -> str:
        if not recorded:
            return f"job {name} has recorded no input range"
        return table(["barrier", "input"], [(barrier_label(r["barrier"]), described(r)) for r in recorded])

    emit(obj, recorded, text)


@job_group.command("next-barrier")
@click.argument("name")
@click.option("--no-skip", is_flag=True, help="The job reads the barrier itself: never skip unchanged barriers.")
@click.option("--no-coalesce", is_flag=True, help="Complete every barrier exactly, one computation each.")
@click.pass_obj
def next_barrier(obj, name: str, no_skip: bool, no_coalesce: bool) -> None:
    """The plan job NAME follows next: a barrier and how to complete it.

    exact: the next barrier, computed. skip: no source changed up to the barrier; complete it
    with no computation. coalesce: one computation for every barrier since the job's progress
    up to this one (never past an anchor). A root job gets a new barrier when the newest is
    older than the barrier interval; an intermediate job's barrier is ready once all its
    sources have completed it."""
    nb = jobs.next_barrier(obj.conn(), name, skip=not no_skip, coalesce=not no_coalesce)

    def text() -> str:
        how = (
            nb.plan.value
            if nb.from_barrier is None or nb.plan.value == "exact"
            else f"{nb.plan.value} from {barrier_label(nb.from_barrier)}, {nb.anchors_in_range} anchor(s) in range"
        )
        if nb.ready:
            return f"job {name}: next barrier {barrier_label(nb.barrier)}, {how} (ready{', newly issued' if nb.issued else ''})"
        where = f"next barrier {barrier_label(nb.barrier)}" if nb.barrier is not None else "no barrier to complete yet"
        return f"job {name}: {where}, waiting for {nb.describe_wait()}"

    emit(obj, nb.to_json(), text)


def _parse_commit(text: str) -> tuple[TableName, int]:
    table_text, sep, snapshot = text.partition("=")
    try:
        if not sep:
            raise ValueError
        snapshot_id = int(snapshot)
        if not 0 < snapshot_id < 2**63:
            raise ValueError
    except ValueError:
        raise InvalidValueError(
            f"--commit {text!r} is malformed; use TABLE=SNAPSHOT_ID with a positive 64-bit "
            f"snapshot id, e.g. lake.db.orders=123"
        ) from None
    return TableName.parse(table_text), snapshot_id


def _parse_commits(texts) -> dict[TableName, int]:
    """Each sink at most once: a (table, barrier) has one commit."""
    parsed: dict[TableName, int] = {}
    for sink, snapshot_id in map(_parse_commit, texts):
        if sink in parsed:
            raise InvalidValueError(
                f"--commit names {sink} twice ({parsed[sink]} and {snapshot_id}); a table has "
                f"one commit per barrier, give it once"
            )
        parsed[sink] = snapshot_id
    return parsed


@job_group.command("complete")
@click.argument("name")
@click.option("--barrier", "barrier", type=BARRIER, required=True, help="The barrier completed.")
@click.option(
    "--commit",
    "commits",
    multiple=True,
    metavar="TABLE=SNAPSHOT_ID",
    help="Snapshot written to a sink for this barrier (repeatable); other sinks keep theirs.",
)
@click.option("--run-id", help="Identifier of the run that wrote the commits.")
@click.option(
    "--coalesce",
    is_flag=True,
    help="Coalesce the barriers between the job's progress and BARRIER (one computation for all).",
)
@click.pass_obj
def complete(obj, name: str, barrier: int, commits, run_id: str | None, coalesce: bool) -> None:
    """Record that job NAME completed BARRIER for all its sinks, in one transaction.

    Barriers between the job's progress and BARRIER are skipped (refused if a source changed
    among them) or, with --coalesce, coalesced (refused across an anchor)."""
    parsed = _parse_commits(commits)
    result = jobs.complete(obj.conn(), name, barrier, parsed, run_id=run_id, coalesce=coalesce)
    what = "already completed (no change)" if result.noop else "completed"
    emit(
        obj,
        result.to_json(),
        f"job {name}: barrier {barrier_label(barrier)} {what} for {', '.join(map(str, result.sinks))}",
    )


COMMANDS = [job_group]


def catalog_access(credential_help: str):
    """The options naming the catalog a command's jobs run through: ``--catalog-uri`` and
    ``--credential`` (or their environment variables, which `job exec` runs pass on)."""

    def apply(command):
        command = click.option(
            "--ca-cert",
            envvar=CA_CERT_ENV,
            type=click.Path(exists=True, dir_okay=False),
            help="The CA (PEM) of the server's certificate, for https with a CA of your own; the "
            "command's engines are told to trust it too [env ICEBARRIER_CA_CERT].",
        )(command)
        command = click.option(
            "--credential",
            envvar="ICEBARRIER_CATALOG_CREDENTIAL",
            metavar="CLIENT_ID:SECRET",
            help=f"{credential_help} [env ICEBARRIER_CATALOG_CREDENTIAL].",
        )(command)
        return click.option(
            "--catalog-uri",
            envvar="ICEBARRIER_CATALOG_URI",
            default="http://127.0.0.1:8181",
            show_default=True,
            help="Where `icebarrier serve` listens [env ICEBARRIER_CATALOG_URI].",
        )(command)

    return apply


@job_group.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--once", "mode", flag_value="once", default=True, help="Complete every barrier due now, then exit.")
@click.option("--follow", "mode", flag_value="follow", help="Keep going until SIGINT/SIGTERM.")
@catalog_access("A token of job NAME, or an admin token")
@click.option(
    "--no-skip", is_flag=True, help="The command reads the barrier itself: run it even when no source changed."
)
@click.option("--no-coalesce", is_flag=True, help="Complete every barrier exactly, one run each.")
@click.option(
    "--poll",
    default="1h",
    show_default=True,
    help="--follow waits at the catalog, which wakes it when the job has work; this is how long one wait lasts "
    "(the catalog keeps the connection alive meanwhile).",
)
@click.option(
    "--hold",
    default="30s",
    show_default=True,
    help="How long the session stays held if this process dies (another run may then take it over).",
)
@click.pass_obj
def exec_(
    obj,
    name: str,
    command,
    mode: str,
    catalog_uri: str,
    credential: str | None,
    ca_cert: str | None,
    no_skip: bool,
    no_coalesce: bool,
    poll: str,
    hold: str,
) -> None:
    """Run COMMAND as job NAME through the catalog: once per planned barrier, publishing the
    barrier when it exits 0 (nothing of a failed run is visible).

    COMMAND gets the catalog configuration of Spark, PyIceberg and DuckDB in its environment
    (docs/job-exec.md); through it the job's sources read at the barrier and its writes to its
    sinks are staged until the barrier is published. Write `--` before COMMAND.

    Exit codes: 0 every planned barrier published (or nothing was due); COMMAND's own code
    when it failed (128+N: killed by signal N), nothing published for that barrier; 1 the
    catalog refused (one line says why); 2 bad usage."""
    from icebarrier.apps.job_exec import JobExec

    parse_job_name(name)
    if not credential:
        raise click.UsageError(
            "no catalog credential: pass --credential CLIENT_ID:SECRET (a token of the job, from "
            "`icebarrier token create --job JOB`) or set ICEBARRIER_CATALOG_CREDENTIAL"
        )
    runner = JobExec(
        name,
        list(command),
        uri=catalog_uri,
        credential=credential,
        ca_cert=ca_cert,
        skip=not no_skip,
        coalesce=not no_coalesce,
        hold_s=parse_duration_s(hold),
        log=lambda line: click.echo(line, err=True),
    )
    summary = runner.run(follow=mode == "follow", poll_s=parse_duration_s(poll))
    published = [s for s in summary.steps if s.outcome != "failed"]
    emit(
        obj,
        summary.to_json(),
        f"job {name}: {len(published)} barrier(s) completed"
        + (f", the last {published[-1].barrier}" if published else ""),
    )
    if summary.exit_code:
        sys.exit(summary.exit_code)
