"""Output: aligned text tables for people, stable JSON for scripts."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

import click

from icebarrier.control_plane.model import barrier_label, format_duration_s  # noqa: F401 - for the commands


def emit(ctx_obj, payload, text: str | Callable[[], str]) -> None:
    """Print ``payload`` as JSON with --output json, else the text (or what it returns)."""
    if ctx_obj.output == "json":
        click.echo(json.dumps(payload, indent=2, sort_keys=True, default=str))
    else:
        click.echo(text() if callable(text) else text)


PAGE = 1000  # rows a listing prints unless asked for more


def paging(command):
    """``--limit`` and ``--after`` (and ``--all``) for a listing by name: a lake of 100,000 tables
    prints a page, and says how to get the next."""
    command = click.option("--all", "everything", is_flag=True, help="Every row, however many.")(command)
    command = click.option("--after", metavar="NAME", help="Start after this name (the next page).")(command)
    return click.option(
        "--limit", type=click.IntRange(1), default=PAGE, show_default=True, help="At most this many rows."
    )(command)


def page(items: list, *, limit: int | None, name: Callable[[object], str], what: str, command: str) -> list:
    """The first ``limit`` of ``items`` (fetched one over the limit); if there are more, say on
    standard error how to get the next page."""
    if limit is None or len(items) <= limit:
        return items
    shown = items[:limit]
    last = name(shown[-1])
    click.echo(
        f"{limit} {what} shown (by name), more follow; the next page: icebarrier {command} --after "
        f"{shlex.quote(last)} (or --all)",
        err=True,
    )
    return shown


class Seconds(float):
    """A duration cell of :func:`table`: its column shows all its durations in one unit."""


_UNITS = (("ms", 1e-3), ("s", 1.0), ("min", 60.0), ("h", 3600.0))


def _unit_for(values: list[float]) -> tuple[str, float]:
    """The unit a column of durations reads best in: the largest its median is at least 1 of
    (milliseconds below a second)."""
    middle = sorted(abs(v) for v in values)[len(values) // 2]
    return next(((u, f) for u, f in reversed(_UNITS) if middle >= f), _UNITS[0])


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *, empty: str = "(none)") -> str:
    """A plain text table; a column of :class:`Seconds` is shown in one unit, named in its header."""
    rows, headers = [list(r) for r in rows], list(headers)
    for i in range(len(headers)):
        column = [r[i] for r in rows if isinstance(r[i], Seconds)]
        if column:
            unit, factor = _unit_for(column)
            headers[i] = f"{headers[i]} ({unit})"
            for r in rows:
                if isinstance(r[i], Seconds):
                    r[i] = f"{r[i] / factor:.1f}" if unit != "ms" else f"{r[i] / factor:.0f}"
    rows = [["-" if v is None else str(v) for v in row] for row in rows]
    if not rows:
        return empty
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def ago(when: datetime | None) -> str:
    if when is None:
        return "-"
    return format_duration_s((datetime.now(UTC) - when).total_seconds()) + " ago"


duration = format_duration_s

# A barrier on the command line: a positive int64 (microseconds since the epoch).
BARRIER = click.IntRange(1, 2**63 - 1)


def one_line(text: str) -> str:
    """A message safe to print as one line: control characters (newlines, terminal escape
    sequences) in names a user typed are shown escaped, never interpreted."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode() for c in text)


def terminal_progress(*columns):
    """A live rich progress display on stderr when it is a terminal (gone once done), else None
    (a pipe, CI: the messages alone). Print lines above it with :func:`above`."""
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(stderr=True), transient=True)


def above(bars) -> Callable[[str], None]:
    """Print a line above a live progress display, as it is (no rich markup)."""
    return lambda line: bars.console.print(line, markup=False, highlight=False)
