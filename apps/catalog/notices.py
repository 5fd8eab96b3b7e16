"""The control plane's notices in a server process: one LISTEN connection (a thread), routed to
the requests that wait on the event loop (``icebarrier job exec --follow`` long-polls its
session: see :mod:`.sessions`). A waiting request costs the database nothing.

A request registers a :class:`Watch` before it plans (the hub keeps recent notices by key, so
one raised meanwhile is not lost: holding the plan's wait reads those under its keys), then
waits for a notice its :class:`~icebarrier.control_plane.notices.Wait` finds worth planning
again for, or its time.
A long poll that ends with nothing new stays watched for a while (:class:`Parked`): its job's
next ask, if nothing woke it meanwhile, goes on waiting without planning again — a renewal costs
the database the token's look-up and nothing else.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import signal
import threading
import time
import zlib
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from icebarrier.control_plane.job_sessions import HEARTBEAT_S, Opening
from icebarrier.control_plane.notices import Listener, Notice, Wait

LONG_POLL_EVENTS = ("planned", "woken", "due", "renewed", "heartbeat")  # Hub.events
RECENT_S = 120.0  # notices kept this long for the requests planning meanwhile (one planning longer plans again)
PARK_S = 60.0  # a long poll that ended with nothing new is kept this long for its job's next ask
REPLAN_S = 900.0  # a long poll plans again from the database once in this long (a safety net: replan_s)


def replan_s(job: str, now: float | None = None) -> float:
    """Seconds until a long poll's plan is due again (the safety net): its job's own point of
    every REPLAN_S (by a hash of its name, the same in every server process). Jobs that plan
    together (2,000 long polls asking again the moment a server restarted, and planning again on
    the notices of the catch-up that follows) are due again spread over REPLAN_S from the start,
    whatever woke them meanwhile: one plan on time per job every REPLAN_S, never a wave (a plan
    at its point, a timer's moment early, is due the next one)."""
    due_s = (zlib.crc32(job.encode()) / 2**32 * REPLAN_S - (time.time() if now is None else now)) % REPLAN_S
    return due_s if due_s >= 1.0 else due_s + REPLAN_S


class Watch:
    """One waiting request's inbox (used on the event loop only). Until it holds a
    :class:`Wait` it is routed nothing: :meth:`hold` then reads what came meanwhile for its keys
    from the hub's recent notices (a notice costs the watches it concerns, not every request
    that is planning)."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub
        self._since: int | None = hub.seq  # notices after this one are pending until held
        self._wait: Wait | None = None
        self._set = False  # woken (or poked) since the wait was held
        self._poked = False  # set only for the wait's due time, which came nearer
        self._waiter: asyncio.Future | None = None  # the request waiting in until(), if one is

    @property
    def waiting(self) -> bool:
        return self._wait is not None

    def close(self) -> None:
        """The server is stopping: end the wait now (the request answers; its client asks again)."""
        self._wake()

    def _wake(self, *, poke: bool = False) -> None:
        self._set, self._poked = True, poke
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def offer(self, notice: Notice) -> None:
        if self._wait is None:
            return
        due_at = self._wait.due_at
        if self._wait.wakes(notice):
            self._wake()
        elif self._wait.due_at < due_at and not self._set:  # due sooner (an announcement)
            self._wake(poke=True)

    @property
    def woken(self) -> bool:
        """A notice woke the wait it holds (a parked long poll's)."""
        return self._wait is not None and self._set and not self._poked

    def hold(self, wait: Wait) -> None:
        """Watch for what wakes ``wait`` from now on (and what came while the request planned),
        with or without a request waiting. Holding it already: nothing to do."""
        if self._wait is wait:
            return
        self._wait, self._set, self._poked = wait, False, False
        keys = {"jobs", "resync", *wait.tables, *wait.sinks, *(f"input {i}" for i in wait.announced)}
        keys |= {"barrier"} if wait.root else set()  # waiting for an announcement: once one came
        self._hub.route(self, keys)
        since, self._since = self._since, None
        if since is not None and self._hub.wakes_since(since, keys, wait):
            self._set = True

    def _release(self) -> None:
        """The wait ended: routed nothing, what comes from now on pending until it holds again."""
        self._wait, self._since = None, self._hub.seq
        self._hub.route(self, set())

    async def until(self, wait: Wait, *, limit_s: float) -> bool:
        """Wait until a notice wakes ``wait``, its due time, or ``limit_s``; whether a notice woke it.
        Ended by ``limit_s`` before its due time (the long poll's end), it stays held: a notice
        meanwhile wakes the next call (its job's next long poll, which takes it up) at once, and
        holding again costs nothing. Woken or due, it is released: what comes while the caller
        plans again is pending until it holds its next wait. (A future and a timer: no task and no
        exception, which asyncio.wait_for would cost.)"""
        if self._hub.closing:
            return False
        self.hold(wait)  # held already (parked by the job's last long poll): with what woke it since
        loop = asyncio.get_running_loop()
        end = time.monotonic() + limit_s
        woke = False
        try:
            while True:
                if not self._set:
                    timeout = min(wait.remaining_s(), end - time.monotonic())
                    if timeout <= 0:
                        return False
                    self._waiter = loop.create_future()
                    timer = loop.call_later(timeout, _resolve, self._waiter)
                    try:
                        await self._waiter
                    finally:
                        timer.cancel()
                        self._waiter = None
                    if not self._set:
                        continue  # its time (the loop sees it)
                if not self._poked:
                    woke = True
                    return True
                self._set = self._poked = False  # its due time came nearer: wait to that
        finally:
            if woke or wait.remaining_s() <= 0 or self._hub.closing:
                self._release()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(slots=True, eq=False)
class Voice:
    """What a waiting long poll says every heartbeat (``line``; None once its last line comes),
    said by the hub's one heartbeat task through the stream's ASGI ``send``: the stream's own task
    is not woken for it, which halves what a line costs (docs/scale.md)."""

    line: bytes | None = None
    send: Callable[[dict], Awaitable[None]] | None = None


@dataclass(slots=True)
class Parked:
    """A long poll that ended with nothing new for its job, kept for the job's next ask: its
    watch still holds ``wait``, so a renewal that finds it not woken needs no plan."""

    watch: Watch
    wait: Wait
    opening: Opening  # what the job waits for
    answer: dict
    parked_at: float = 0.0


class Hub:
    """Routes one listener's notices to the watches of this process's event loop, and keeps the
    long polls that ended with nothing new (:class:`Parked`) for their jobs' next asks."""

    def __init__(self, dsn: str | None, schema: str | None, *, heartbeat_s: float = HEARTBEAT_S) -> None:
        self._listener = Listener(dsn, schema)
        self.heartbeat_s = heartbeat_s  # a long poll with nothing to say says what it waits for this often
        self._by_key: dict[str, set[Watch]] = defaultdict(set)
        self._keys: dict[Watch, set[str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closing = False  # SIGTERM came: no request waits any more
        self._parked: dict[tuple, Parked] = {}
        self.seq = 0  # notices delivered so far
        self._recent: dict[str, deque[tuple[int, Notice]]] = defaultdict(deque)  # by key, oldest first
        self._arrived: deque[tuple[float, int, str]] = deque()  # (when, seq, key), oldest first
        self._forgotten = 0  # the newest notice no longer kept
        # what the long polls cost, by event (``/metrics``): planned (a request's first plan),
        # woken (a notice woke it: planned again), due (its due time came: planned again),
        # renewed (a job's next ask took up its parked poll: no plan), heartbeat (a line said)
        self.events: Counter[str] = Counter()
        self._voices: list[tuple[float, int, Voice]] = []  # (due, tie, voice): a heap
        self._tie = itertools.count()
        self._heartbeats: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._heartbeats = self._loop.create_task(self._say_heartbeats())
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

    def speak(self, voice: Voice) -> None:
        """Say ``voice.line`` every heartbeat from now on, until it is None."""
        heapq.heappush(self._voices, (time.monotonic() + self.heartbeat_s, next(self._tie), voice))

    async def _say_heartbeats(self) -> None:
        """Say each waiting long poll's line every heartbeat, one after the other. A send waits
        only for a client that has read nothing while its socket's buffers filled with lines
        (days of them); a long poll lasts an hour at most."""
        voices = self._voices
        while True:
            await asyncio.sleep(min(1.0, max(0.05, voices[0][0] - time.monotonic())) if voices else 1.0)
            now = time.monotonic()
            while voices and voices[0][0] <= now:
                voice = heapq.heappop(voices)[2]
                if voice.line is None or voice.send is None:
                    continue
                try:
                    await voice.send({"type": "http.response.body", "body": voice.line, "more_body": True})
                except Exception:  # noqa: BLE001 - this stream's trouble: it ends on its own, the others go on
                    voice.line = None
                    continue
                self.events["heartbeat"] += 1
                heapq.heappush(voices, (now + self.heartbeat_s, next(self._tie), voice))

    def stop(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
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
        """The long poll kept under ``key``, if nothing woke it (else None: plan again; one whose
        plan came due meanwhile (:func:`replan_s`) plans again as it is taken up)."""
        parked = self._parked.pop(key, None)
        if parked is None:
            return None
        if self.closing or parked.watch.woken:
            self.forget(parked.watch)
            return None
        return parked

    def _expire(self, key: tuple, parked: Parked, parked_at: float) -> None:
        if self._parked.get(key) is parked and parked.parked_at == parked_at:  # its job did not ask again
            del self._parked[key]
            self.forget(parked.watch)

    def watch(self) -> Watch:
        """A watch that keeps what comes from now on for the wait it will hold."""
        return Watch(self)

    def wakes_since(self, since: int, keys: set[str], wait: Wait) -> bool:
        """Whether a notice after ``since`` under one of ``keys`` wakes ``wait`` (fed them in
        order); True when some of them are no longer kept."""
        if since < self._forgotten:
            return True
        came = []
        for key in keys:
            for seq, notice in reversed(self._recent.get(key, ())):
                if seq <= since:
                    break
                came.append((seq, notice))
        return any([wait.wakes(notice) for _, notice in sorted(came, key=lambda c: c[0])])

    def forget(self, watch: Watch) -> None:
        self.route(watch, set())

    def route(self, watch: Watch, keys: set[str]) -> None:
        for key in self._keys.pop(watch, ()):
            routed = self._by_key[key]
            routed.discard(watch)
            if not routed:
                del self._by_key[key]
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
        now = time.monotonic()
        for notice in notices:
            self.seq += 1
            key = notice.key
            self._recent[key].append((self.seq, notice))
            self._arrived.append((now, self.seq, key))
            for watch in tuple(self._by_key.get(key, ())):
                watch.offer(notice)
        while self._arrived and self._arrived[0][0] < now - RECENT_S:
            _, self._forgotten, key = self._arrived.popleft()
            kept = self._recent[key]
            kept.popleft()
            if not kept:
                del self._recent[key]
