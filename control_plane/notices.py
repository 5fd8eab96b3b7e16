"""Push, not poll (DESIGN.md, "Cost of waiting"): what the control plane announces, and a job's
wait for what concerns it.

Triggers (migration 0012) raise a notification on channel ``icebarrier.<schema>`` when a
barrier is issued, a managed table's watermark moves, or the jobs change; Postgres delivers it
when the transaction commits. A :class:`Listener` is one connection that LISTENs; waiting on
it costs the database nothing. A :class:`Wait` decides, from what a job's plan said it waits
for and the notices since, whether planning again is worth a transaction — and when a slow
safety poll is due anyway (a notice is lost if the listener was disconnected).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from icebarrier.control_plane import db
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import ControlPlaneUnavailableError
from icebarrier.control_plane.jobs import NextBarrier

SAFETY_POLL_S = 60.0  # a waiting job plans again this often even if no notice came
CLOCK_GRACE_S = 0.25  # a root job looks for the clock's barrier this long after it is due (see due_after_s)


def due_after_s(due_in_s: float) -> float:
    """When a root job plans again for the clock's next barrier, due in ``due_in_s`` (negative:
    overdue). A little after: when it is due, `icebarrier schedule` (or another job) is issuing
    it, in a transaction that runs the first wave of skips (about 0.1 s at 2,000 jobs); its
    notice then wakes the job, and a look at the due time itself would find nothing yet. The job
    issues the barrier itself when nobody else did."""
    return max(due_in_s, 0.0) + CLOCK_GRACE_S


def channel(schema: str) -> str:
    return f"icebarrier.{schema}"


def loads_channel(schema: str) -> str:
    """Where what a load reads announces its changes (migration 0022): ``tokens`` or ``cuts``.
    Its own channel: waiting jobs do not wake for them."""
    return f"icebarrier_loads.{schema}"


def pointers_channel(catalog_schema: str) -> str:
    """Where the SQL catalog in ``catalog_schema`` announces a changed pointer row, its key as
    the JSON array ``[catalog, namespace, table]`` (``iceberg_ext.catalog.watch_pointers``)."""
    return f"icebarrier_pointers.{catalog_schema}"


@dataclass(frozen=True, slots=True)
class Notice:
    """``barrier`` (B issued), ``watermark`` (``table`` moved to B; B None: rewound to nothing),
    ``input`` (data arrived in the external input named ``table``; ``due_in_s``: when the clock's
    next barrier was due then, payload ``input NAME SECONDS``, 0033), ``jobs`` (registrations
    changed) or ``resync`` (the listener reconnected: notices were missed).

    A ``watermark`` notice after a wave of skips names the table's readers ``behind`` it, each
    with its progress (payload ``watermark B table/job@P,job@-``; neither a table's nor a job's
    name holds a ``/``, a job's no ``,`` or ``@``; ``-``: it completed nothing): the others were
    skipped with the move. None: not said (every reader may be behind)."""

    kind: str
    barrier: int | None = None
    table: str | None = None
    behind: dict[str, int | None] | None = None
    due_in_s: float | None = None

    @classmethod
    def parse(cls, payload: str) -> Notice:
        kind, _, rest = payload.partition(" ")
        if kind == "barrier":
            return cls(kind, int(rest))
        if kind == "watermark":
            mark, _, table = rest.partition(" ")
            table, named, behind = table.partition("/")
            return cls(kind, _barrier(mark), table, dict(map(_reader, behind.split(","))) if named else None)
        if kind == "input":
            name, _, due = rest.partition(" ")  # an input's name holds no space
            return cls(kind, table=name, due_in_s=float(due) if due not in ("", "-") else None)
        return cls(kind)

    @property
    def key(self) -> str:
        """What a waiter is routed by: a table's or an input's name, else the kind."""
        if self.kind == "input":
            return f"input {self.table}"
        return self.table if self.kind == "watermark" and self.table else self.kind


RESYNC = Notice("resync")


def _barrier(text: str) -> int | None:
    return None if text in ("-", "") else int(text)


def _reader(text: str) -> tuple[str, int | None]:
    """``job@P`` (0033), or ``job`` (0032: its progress not said)."""
    job, _, progress = text.partition("@")
    return job, _barrier(progress)


class Listener:
    """A connection LISTENing to the control plane's notices (its own; autocommit). Listen
    before planning: a notice raised between the plan and the wait is then not lost."""

    def __init__(self, dsn: str | None, schema: str | None) -> None:
        self._dsn, self._schema = dsn, schema
        self.conn: Conn | None = None
        self._pending: list[Notice] = []

    def open(self) -> Listener:
        self.conn = db.connect(self._dsn, self._schema)
        schema = self.conn.info_schema  # type: ignore[attr-defined]
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel(schema))))
        return self

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self) -> Listener:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self, timeout_s: float) -> list[Notice]:
        """The notices that arrive within ``timeout_s`` (returns at the first, with any already
        queued). A lost connection is reopened, and reported as :data:`RESYNC`."""
        if self.conn is None or self.conn.closed:
            return self._reopen(timeout_s)
        try:
            found = [Notice.parse(n.payload) for n in self.conn.notifies(timeout=max(timeout_s, 0.0), stop_after=1)]
            if found:
                found += [Notice.parse(n.payload) for n in self.conn.notifies(timeout=0.0)]
        except psycopg.OperationalError:
            self.close()
            time.sleep(min(timeout_s, 1.0))
            return self._reopen(timeout_s)
        return found

    def _reopen(self, timeout_s: float) -> list[Notice]:
        """[RESYNC] once listening again; [] while the control plane is away (found by
        `icebarrier check`: a failed reopen used to end the catalog server's listener thread)."""
        try:
            self.open()
        except (psycopg.OperationalError, ControlPlaneUnavailableError):
            self.close()
            time.sleep(min(timeout_s, 1.0))
            return []
        return [RESYNC]


@dataclass(slots=True)
class Wait:
    """What a job with nothing to do waits for, from its plan: a root job the next barrier (one
    whose inputs are announced: an announcement, while none is pending); any other job its
    sources reaching the barrier it plans (``waiting``, short of ``target``), or its own sinks
    rewound (a revision).

    ``tables`` holds every source's mark (the plan's, then the notices'), ``progress`` the job's:
    a notice that names the job says its progress, and a move of its own sinks is its progress
    (a wave skipped it). Once the job ``moved`` past its plan, what it waits for is every source
    past its progress: without that no plan has work. The marks stay true for it: a move is
    announced, naming the job, whenever the job was not skipped with it.
    ``due_at``: when planning again is due regardless (the clock's next barrier for a root job;
    the safety poll). ``job``: whose wait (a move whose notice names the readers behind it does
    not wake a job it does not name: the move's wave skipped it past it)."""

    tables: dict[str, int | None] = field(default_factory=dict)
    job: str | None = None
    target: int | None = None
    root: bool = False
    sinks: frozenset[str] = frozenset()
    progress: int | None = None
    announced: frozenset[str] = frozenset()  # a root job's inputs, announced, none since its progress
    due_at: float = 0.0  # time.monotonic()
    waiting: frozenset[str] | None = None  # the sources short of target at the plan (None: every one)
    moved: bool = False  # the job's progress moved past its plan's

    @classmethod
    def of(
        cls, plan: NextBarrier, *, root: bool, due_in_s: float | None = None, safety_s: float = SAFETY_POLL_S
    ) -> Wait:
        due = safety_s if due_in_s is None else min(due_after_s(due_in_s), safety_s)
        return cls(
            tables={**plan.waiting_for, **plan.marks},
            job=plan.job,
            target=plan.barrier,
            root=root,
            sinks=frozenset(plan.sinks),
            progress=plan.from_barrier,
            announced=frozenset(plan.announced) if plan.waits_for_announcement else frozenset(),
            due_at=time.monotonic() + due,
            waiting=frozenset(plan.waiting_for),
        )

    def remaining_s(self) -> float:
        return self.due_at - time.monotonic()

    def wakes(self, notice: Notice) -> bool:
        """Whether ``notice`` makes planning again worth a transaction."""
        if notice.kind in ("jobs", "resync"):
            return True
        if notice.kind == "barrier":
            return self.root and not self.announced  # an announced input brings nothing new by itself
        if notice.kind == "input":
            if notice.table not in self.announced:
                return False
            if notice.due_in_s is None:  # not said (no barrier yet): plan now to learn when
                return True
            self.announced = frozenset()  # pending: its data runs at the next barrier, whose notice wakes it
            self.due_at = min(self.due_at, time.monotonic() + due_after_s(notice.due_in_s))  # or the clock
            return False
        if notice.kind != "watermark":
            return False
        if notice.table in self.sinks:  # its own: moved on by a wave, or rewound by a revision
            if notice.barrier is None or (self.progress is not None and notice.barrier < self.progress):
                return True
            self._moved_to(notice.barrier)
            return False
        if notice.table not in self.tables:
            return False
        self.tables[notice.table] = notice.barrier
        if notice.barrier is None:  # a rewind
            return True
        if notice.behind is not None and self.job is not None:
            if self.job not in notice.behind:
                return False  # skipped with the move: nothing new for it
            self._moved_to(notice.behind[self.job])
        return self._has_work()

    def _moved_to(self, progress: int | None) -> None:
        if progress is not None and (self.progress is None or progress > self.progress):
            self.progress, self.moved = progress, True

    def _has_work(self) -> bool:
        """Whether a plan may find work, from the marks known (never false when it would)."""
        if self.moved or self.target is None:  # no barrier planned, or planned for a progress left behind
            return self.progress is None or all(
                mark is not None and mark > self.progress for mark in self.tables.values()
            )
        waiting = self.tables.keys() if self.waiting is None else self.waiting
        return bool(waiting) and all((mark := self.tables.get(t)) is not None and mark >= self.target for t in waiting)
