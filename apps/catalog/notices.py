"""The control plane's notices in a server process: one LISTEN connection (a thread), routed to
the requests that wait on the event loop (``icebarrier job exec --follow`` long-polls its
session: see :mod:`.sessions`). A waiting request costs the database nothing.

A request registers a :class:`Watch` before it plans (everything is kept until it knows what
it waits for, so a notice raised meanwhile is not lost), then waits for a notice its
:class:`~icebarrier.control_plane.notices.Wait` finds worth planning again for, or its time.
A long poll that ends with nothing new stays watched for a while (:class:`Parked`): its job's
next ask, if nothing woke it meanwhile, goes on waiting without planning again — a renewal costs
the database the token's look-up and nothing else.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from icebarrier.control_plane.job_sessions import Opening
from icebarrier.control_plane.notices import Listener, Notice, Wait

_ALL = "*"
PARK_S = 60.0  # a long poll that ended with nothing new is kept this long for its job's next ask
REPLAN_S = 900.0  # a kept plan is planned again from the database at least this often (a safety net)


class Watch:
    """One waiting request's inbox (used on the event loop only)."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub
        self._notices: list[Notice] = []
        self._wait: Wait | None = None
        self._event = asyncio.Event()

    @property
    def waiting(self) -> bool:
        return self._wait is not None

    def close(self) -> None:
        """The server is stopping: end the wait now (the request answers; its client asks again)."""
        self._event.set()

    def offer(self, notice: Notice) -> None:
        if self._wait is None:
            self._notices.append(notice)
        elif self._wait.wakes(notice):
            self._event.set()

    @property
    def woken(self) -> bool:
        """A notice woke the wait it holds (a parked long poll's)."""
        return self._wait is not None and self._event.is_set()

    def hold(self, wait: Wait) -> None:
        """Watch for what wakes ``wait`` from now on (and what came while the request planned),
        with or without a request waiting."""
        pending, self._notices = self._notices, []
        self._wait, self._event = wait, asyncio.Event()
        keys = {"jobs", "resync", *wait.tables, *wait.sinks, *(f"input {i}" for i in wait.announced)}
        keys |= {"barrier"} if wait.root and not wait.announced else set()
        self._hub.route(self, keys)
        if any([wait.wakes(n) for n in pending]):
            self._event.set()

    async def until(self, wait: Wait, *, limit_s: float) -> bool:
        """Wait until a notice wakes ``wait``, its due time, or ``limit_s``; whether a notice woke it."""
        if self._hub.closing:
            return False
        if self._wait is not wait:  # else held already (parked), with what woke it since
            self.hold(wait)
        try:
            if not self._event.is_set():
                await asyncio.wait_for(self._event.wait(), timeout=max(min(wait.remaining_s(), limit_s), 0.0))
            return True
        except TimeoutError:
            return False
        finally:
            self._wait = None
            self._hub.route(self, {_ALL})


@dataclass(slots=True)
class Parked:
    """A long poll that ended with nothing new for its job, kept for the job's next ask: its
    watch still holds ``wait``, so a renewal that finds it not woken needs no plan."""

    watch: Watch
    wait: Wait
    opening: Opening  # what the job waits for
    answer: dict
    planned_at: float  # time.monotonic() of the plan from the database
    parked_at: float = 0.0

    @property
    def due_at(self) -> float:
        """When its plan is due regardless of notices (a root job's next barrier), or never."""
        return math.inf if self.opening.due_in_s is None else self.planned_at + self.opening.due_in_s


class Hub:
    """Routes one listener's notices to the watches of this process's event loop, and keeps the
    long polls that ended with nothing new (:class:`Parked`) for their jobs' next asks."""

    def __init__(self, dsn: str | None, schema: str | None) -> None:
        self._listener = Listener(dsn, schema)
        self._by_key: dict[str, set[Watch]] = defaultdict(set)
        self._keys: dict[Watch, set[str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closing = False  # SIGTERM came: no request waits any more
        self._parked: dict[tuple, Parked] = {}

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._listener.open()
        self._thread = threading.Thread(target=self._listen, daemon=True, name="icebarrier-notices")
        self._thread.start()
        self._close_on_signals()

    def _close_on_signals(self) -> None:
        """On SIGTERM or SIGINT, end every wait at once, then do what the server's own handler
        does (stop accepting, let requests in flight finish within the grace period): a long poll
        would otherwise hold the whole grace period and then be cut off without an answer."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous, loop=self._loop):
                loop.call_soon_threadsafe(self.close)
                if callable(previous):
                    previous(signum, frame)

            signal.signal(sig, handler)

    def close(self) -> None:
        """Stop every wait of this process, now and from now on."""
        self.closing = True
        for watch in list(self._keys):
            watch.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._listener.close()

    @property
    def waiting(self) -> int:
        """The requests of this process waiting for a notice now (long polls between plans)."""
        return sum(1 for watch in list(self._keys) if watch.waiting) - len(self._parked)

    def park(self, key: tuple, parked: Parked) -> None:
        """Keep ``parked`` for the next ask under ``key`` (a job and how it asks), for PARK_S."""
        if (previous := self._parked.pop(key, None)) is not None:
            self.forget(previous.watch)
        parked.watch.hold(parked.wait)
        parked.parked_at = time.monotonic()
        self._parked[key] = parked
        asyncio.get_running_loop().call_later(PARK_S, self._expire, key, parked, parked.parked_at)

    def parked(self, key: tuple) -> Parked | None:
        return self._parked.get(key)

    def unpark(self, key: tuple) -> Parked | None:
        """The long poll kept under ``key``, if nothing woke it and its plan is recent (else
        None: plan again)."""
        parked = self._parked.pop(key, None)
        if parked is None:
            return None
        if self.closing or parked.watch.woken or time.monotonic() - parked.planned_at >= REPLAN_S:
            self.forget(parked.watch)
            return None
        return parked

    def _expire(self, key: tuple, parked: Parked, parked_at: float) -> None:
        if self._parked.get(key) is parked and parked.parked_at == parked_at:  # its job did not ask again
            del self._parked[key]
            self.forget(parked.watch)

    def watch(self) -> Watch:
        found = Watch(self)
        self.route(found, {_ALL})
        return found

    def forget(self, watch: Watch) -> None:
        self.route(watch, set())

    def route(self, watch: Watch, keys: set[str]) -> None:
        for key in self._keys.pop(watch, ()):
            self._by_key[key].discard(watch)
        if keys:
            self._keys[watch] = keys
            for key in keys:
                self._by_key[key].add(watch)

    def _listen(self) -> None:
        loop = self._loop
        assert loop is not None  # started by start()
        while not self._stop.is_set():
            notices = self._listener.wait(1.0)
            if notices:
                loop.call_soon_threadsafe(self._deliver, notices)

    def _deliver(self, notices: list[Notice]) -> None:
        for notice in notices:
            for watch in (*self._by_key.get(notice.key, ()), *self._by_key.get(_ALL, ())):
                watch.offer(notice)
