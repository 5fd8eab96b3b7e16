"""``icebarrier check``: the seeded consistency checker."""

from __future__ import annotations

import random
import sys

import click

from icebarrier.cli.render import emit, table
from icebarrier.apps.scratch import scratch


@click.command("check")
@click.option("--seed", type=int, help="Seed to reproduce a run (default: random, printed).")
@click.option("--duration", "duration_s", type=click.FloatRange(3, 86400), default=20, show_default=True,
              help="Seconds of barriers, jobs, faults, readers and expiry before the final validation.")
@click.option("--fault-rate", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="Chance that a job process is started with a random fault point armed.")
@click.option("--keep", is_flag=True, help="Keep the scratch database and warehouse for inspection.")
@click.pass_obj
def check(obj, seed: int | None, duration_s: float, fault_rate: float, keep: bool) -> None:
    """Run root and intermediate jobs as real processes at random speeds, kill them at random
    fault points and restart them, while readers query at every level and expiry runs; validate
    everything against a model. Exits 1 on any anomaly at read-committed or repeatable-read,
    any lost or duplicated (table, barrier), or any pinned snapshot expired."""
    from icebarrier.apps.check import Env, run_check
    from icebarrier.iceberg_ext.catalog import upgrade
    from icebarrier.iceberg_ext.config import Settings

    seed = seed if seed is not None else random.randrange(1, 1_000_000)
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    say(f"check: seed {seed} (reproduce with --seed {seed})")
    with scratch(obj, "check", say, keep=keep) as (dsn, warehouse):
        settings = Settings(dsn=dsn, schema="icebarrier", warehouse=str(warehouse)).validated()
        upgrade(settings)
        report = run_check(Env(settings=settings, ns=f"check_{seed}", seed=seed), duration_s=duration_s,
                           fault_rate=fault_rate, progress=say)

    def text() -> str:
        rows = [(lvl, report.reads[lvl], report.anomalies[lvl], report.examples.get(lvl, "-")) for lvl in report.reads]
        lines = [f"seed {report.seed}: {report.barriers} barriers", table(["level", "reads", "anomalies", "example"], rows)]
        lines.append("faults injected: " + (", ".join(f"{k} x{v}" for k, v in sorted(report.faults.items()) if v)
                                             or "none"))
        lines.append(f"expiry: {report.snapshots_expired} snapshots expired, {report.pinned_expired} of them pinned; "
                     f"{report.leases_refused} lease(s) refused")
        lines.append(f"repeatable-read sessions that saw a change: {report.repeatable_read_changes}")
        lines += [f"VIOLATION: {v}" for v in report.violations]
        lines.append("OK" if report.ok else f"FAILED (reproduce with --seed {report.seed})")
        return "\n".join(lines)

    emit(obj, report.to_json(), text)
    if not report.ok:
        sys.exit(1)


COMMANDS = [check]
