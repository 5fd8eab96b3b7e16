"""``icebarrier serve --workers N``: one process accepts every connection and hands it to the
worker process that holds the fewest.

Worker processes that share one listening socket split connections by who wakes first: the
first accepts every connection already queued, so four clients that connect together can all
land on one process while the other idles (1 opening in 20, measured; ``docs/peers.md``). Here
the supervising process alone accepts, and passes each connection's descriptor (``SCM_RIGHTS``)
over a Unix socket to the ready worker with the fewest open connections, as Node's cluster
module does by default. Each worker serves what it is handed with uvicorn's own protocol, says
on the same socket when it is ready and that it is alive, and counts the connections it closes
in memory the supervisor reads (before their descriptors close: a connection the worker no
longer has is never counted against it, and a close costs the supervisor nothing). When
every worker's queue is full (their event loops held up while a burst comes in), the
connection accepted is held and offered again, and the rest wait in the listening socket's
backlog: none is dropped. A worker that dies is replaced; one that stops answering for
:data:`HUNG_S` is killed and replaced; one that fails before it serves stops the server, as
uvicorn's workers do.

Messages, one per datagram (``SOCK_SEQPACKET``): to a worker ``c`` with a connection's
descriptor, or ``p`` (are you alive); from a worker ``r`` (ready) or ``p`` (alive).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import uvicorn
from uvicorn.config import STARTUP_FAILURE

logger = logging.getLogger("uvicorn.error")

PING_S = 1.0  # how often the supervisor asks each ready worker whether it is alive
HUNG_S = 30.0  # a worker whose event loop has not answered for this long is killed and replaced
PAUSE_ACCEPT_S = 1.0  # after an accept fails for want of descriptors or memory
RETRY_HELD_S = 0.01  # a connection no worker could take yet is offered again this often
STOP_MARGIN_S = 5.0  # on top of the workers' shutdown grace, before one still running is killed

_SPAWN = multiprocessing.get_context("spawn")


@dataclass(eq=False, slots=True, kw_only=True)
class _Worker:
    process: BaseProcess
    channel: socket.socket
    closed: ctypes.c_longlong  # connections it has closed: it counts them, in memory both processes share
    handed: int = 0
    ready: bool = False
    asked_at: float | None = None  # when it was asked whether it is alive, until it answers


@dataclass(eq=False, slots=True)
class Supervisor:
    """Runs ``count`` workers of ``config``'s app and hands them the connections on its address."""

    config: uvicorn.Config
    count: int
    workers: list[_Worker] = field(default_factory=list)
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    listener: socket.socket | None = None
    listening: bool = False
    accepting: bool = False  # listening, a worker is ready, none held, and no accept failed a moment ago
    accept_after: float = 0.0
    held: socket.socket | None = None  # accepted when every ready worker's queue was full: offered first
    next_ping: float = 0.0
    stopping: bool = False
    failed: bool = False

    def run(self) -> None:
        """Until SIGINT or SIGTERM: then the workers shut down within their grace, and this returns
        (exit 3, uvicorn's, if a worker failed to start)."""
        host = self.config.host
        self.listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.setblocking(False)
        try:
            self.listener.bind((host, self.config.port))
        except OSError as exc:
            self._refuse(exc)
            self.listener.close()
            sys.exit(STARTUP_FAILURE)
        wake, woken = socket.socketpair()
        for end in (wake, woken):
            end.setblocking(False)
        self.selector.register(woken, selectors.EVENT_READ, lambda: woken.recv(64))
        previous = signal.set_wakeup_fd(wake.fileno())
        handlers = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for _ in range(self.count):
                self._spawn()
            while not self.stopping:
                for key, _ in self.selector.select(timeout=RETRY_HELD_S if self.held else PING_S):
                    key.data()
                self._watch()
        finally:
            self.listener.close()
            if self.held is not None:
                self.held.close()
            self._stop_workers()
            signal.set_wakeup_fd(previous)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            wake.close()
            woken.close()
        if self.failed:
            sys.exit(STARTUP_FAILURE)

    def _stop(self, signum: int, _frame) -> None:
        logger.info("Received %s, stopping the workers.", signal.Signals(signum).name)
        self.stopping = True

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        closed = _SPAWN.RawValue("q", 0)
        process = _SPAWN.Process(target=_work, args=(self.config, theirs, closed), name="icebarrier-serve-worker")
        process.start()
        theirs.close()
        ours.setblocking(False)
        worker = _Worker(process=process, channel=ours, closed=closed)
        self.workers.append(worker)
        self.selector.register(ours, selectors.EVENT_READ, functools.partial(self._hear, worker))
        self.selector.register(process.sentinel, selectors.EVENT_READ, functools.partial(self._died, worker))

    def _hear(self, worker: _Worker) -> None:
        """One message (the selector calls again while there are more)."""
        try:
            message = worker.channel.recv(32)
        except BlockingIOError:
            return
        except OSError:
            message = b""
        if not message:  # the worker is exiting; its sentinel says when it is gone
            worker.ready = False
            self._forget(worker.channel)
        elif message == b"r":
            worker.ready = True
            self._listen()
        elif message == b"p":
            worker.asked_at = None

    def _forget(self, fileobj) -> None:
        try:
            self.selector.unregister(fileobj)
        except (KeyError, ValueError):  # already
            pass

    def _died(self, worker: _Worker) -> None:
        self._forget(worker.process.sentinel)
        self._forget(worker.channel)
        worker.process.join()
        worker.channel.close()
        self.workers.remove(worker)
        self._listen()
        if self.stopping:
            return
        code = worker.process.exitcode
        if code == STARTUP_FAILURE:
            logger.error("A worker process failed to start (above); the server stops.")
            self.failed = self.stopping = True
            return
        how = f"by signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"with code {code}"
        logger.warning("Worker process [%d] exited %s; a new one takes its place.", worker.process.pid, how)
        self._spawn()

    def _listen(self) -> None:
        """Accept while a worker is ready. The address opens once every worker first is: clients
        that connect as the server starts are not all handed to the first one up."""
        assert self.listener is not None
        if not self.listening:
            if not self.workers or not all(w.ready for w in self.workers):
                return
            try:
                self.listener.listen(self.config.backlog)
            except OSError as exc:  # another process bound the address too, and listened first
                self._refuse(exc)
                return
            self.listening = True
        wanted = any(w.ready for w in self.workers) and self.held is None and time.monotonic() >= self.accept_after
        if wanted and not self.accepting:
            self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        elif self.accepting and not wanted:
            self.selector.unregister(self.listener)
        self.accepting = wanted

    def _refuse(self, exc: OSError) -> None:
        logger.error(
            "%s:%d: %s; stop the process that listens there or choose another --port.",
            self.config.host,
            self.config.port,
            (exc.strerror or str(exc)).lower(),
        )
        self.failed = self.stopping = True

    def _accept(self) -> None:
        """One connection (the selector calls again while more are queued)."""
        assert self.listener is not None
        try:
            connection, _ = self.listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return
        except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: the queue waits a moment
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            logger.error("Accepting a connection failed (%s); trying again in %.0f s.", exc, PAUSE_ACCEPT_S)
            self.accept_after = time.monotonic() + PAUSE_ACCEPT_S
            self._listen()
            return
        if self._hand(connection):
            connection.close()  # the worker has its own descriptor of it
        else:  # every ready worker's queue is full (their loops are busy): the rest wait in the backlog
            self.held = connection
            self._listen()

    def _hand(self, connection: socket.socket) -> bool:
        """To the ready worker holding fewest (the first of equals), if any can take it now."""
        for worker in sorted((w for w in self.workers if w.ready), key=lambda w: w.handed - w.closed.value):
            try:
                socket.send_fds(worker.channel, [b"c"], [connection.fileno()])
            except OSError:  # its queue is full, or it is going: the next one
                continue
            worker.handed += 1
            return True
        return False

    def _watch(self) -> None:
        now = time.monotonic()
        if self.held is not None and self._hand(self.held):
            self.held.close()
            self.held = None
        if self.listening and not self.accepting:
            self._listen()  # after a pause in accepting, or a connection held
        if now < self.next_ping:
            return
        self.next_ping = now + PING_S
        for worker in self.workers:
            if not worker.ready:
                continue
            if worker.asked_at is None:
                try:
                    worker.channel.send(b"p")
                except OSError:
                    continue
                worker.asked_at = now
            elif now - worker.asked_at > HUNG_S:
                logger.error(
                    "Worker process [%d] has not answered for %.0f s; it is killed and replaced.",
                    worker.process.pid,
                    HUNG_S,
                )
                worker.ready = False
                self._forget(worker.channel)
                worker.process.kill()
                self._listen()

    def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.process.terminate()  # uvicorn's graceful shutdown, within --shutdown-grace
        deadline = time.monotonic() + (self.config.timeout_graceful_shutdown or 0) + STOP_MARGIN_S
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.channel.close()


def _work(config: uvicorn.Config, channel: socket.socket, closed: ctypes.c_longlong) -> None:
    """A worker process: uvicorn's server with no socket of its own, serving what it is handed."""
    config.configure_logging()
    try:
        _HandedServer(config, channel, closed).run(sockets=[])
    except KeyboardInterrupt:  # Ctrl+C reaches the whole process group: the supervisor stops us
        pass


class _HandedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, channel: socket.socket, closed: ctypes.c_longlong) -> None:
        super().__init__(config)
        self.channel = channel
        self.closed = closed  # written by this process's event loop only; the supervisor reads it
        self.handed: set[asyncio.Task] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the app's start-up; no listener
        closed = self.closed

        class Counted(self.config.http_protocol_class):  # type: ignore[name-defined]
            def connection_lost(self, exc: Exception | None) -> None:
                super().connection_lost(exc)
                closed.value += 1  # before the transport closes the descriptor, after this returns

        self.protocol = functools.partial(
            Counted, config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )
        self.channel.setblocking(False)
        asyncio.get_running_loop().add_reader(self.channel.fileno(), self._receive)
        self._tell(b"r")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().remove_reader(self.channel.fileno())
        await super().shutdown(sockets=sockets)

    def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.channel, 8, 1)
            except BlockingIOError:
                return
            except OSError:
                message, fds = b"", []
            if not message:  # the supervisor is gone: stop as on SIGTERM (long polls end at once)
                loop.remove_reader(self.channel.fileno())
                signal.raise_signal(signal.SIGTERM)
                return
            for fd in fds:
                task = loop.create_task(self._serve_one(socket.socket(fileno=fd)))
                self.handed.add(task)
                task.add_done_callback(self.handed.discard)
            if message == b"p":
                self._tell(b"p")

    async def _serve_one(self, connection: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self.protocol, connection, ssl=self.config.ssl)
        except OSError:  # reset before it was served, or a TLS handshake that failed
            self.closed.value += 1  # counted before its descriptor closes, as every close is
            connection.close()

    def _tell(self, message: bytes) -> None:
        try:
            self.channel.send(message)
        except OSError:  # full (asked again) or the supervisor is gone
            pass


def serve(config: uvicorn.Config, workers: int) -> None:
    """Serve ``config``'s app (an import string) from ``workers`` processes behind one acceptor."""
    logger.info("Started parent process [%d]", os.getpid())
    Supervisor(config, workers).run()
