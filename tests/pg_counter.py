"""A TCP proxy in front of Postgres that counts the transactions its clients complete, read off
the wire protocol: a transaction ends where the server reports ReadyForQuery with status idle
after at least one statement ran (CommandComplete, EmptyQueryResponse or ErrorResponse since the
last idle report). What the proxy counts is exactly what the processes behind it asked of the
database — unlike ``pg_stat_database.xact_commit``, which also counts autovacuum, connection
start-ups and every other client of the database, and flushes late.

Counts are up to date with what the clients have received: a client that has its answer can
read the counter at once, no waiting for the proxy.

Clients must connect without TLS or GSS encryption (``sslmode=disable gssencmode=disable``, as
``dsn`` gives), or the proxy could not read the stream.

``notices_late_s``: a connection's stream from its first notification (NotificationResponse) on
reaches the client that much later, in order: a listener whose notices are slow."""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time

from psycopg.conninfo import conninfo_to_dict, make_conninfo

_STATEMENT_ENDS = {b"C", b"I", b"E"}  # CommandComplete, EmptyQueryResponse, ErrorResponse


class TransactionCounter:
    def __init__(self, upstream_dsn: str, *, notices_late_s: float = 0.0) -> None:
        self._late_s = notices_late_s
        params = conninfo_to_dict(upstream_dsn)
        self._upstream = (params.get("host") or "127.0.0.1", int(params.get("port") or 5432))
        self._params = params
        self._lock = threading.Lock()
        self._count = 0
        self._ready = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def dsn(self) -> str:
        """The upstream DSN, pointing at the proxy, unencrypted."""
        return make_conninfo(
            **{
                **self._params,
                "host": "127.0.0.1",
                "port": str(self.port),
                "sslmode": "disable",
                "gssencmode": "disable",
            }
        )

    @property
    def transactions(self) -> int:
        with self._lock:
            return self._count

    @property
    def round_trips(self) -> int:
        """ReadyForQuery messages: one per exchange a client waited for (a simple query, or a
        Sync ending a batch of extended-protocol messages), not counting a connection's start-up
        (a pool opening one in the background is not a statement of anyone's)."""
        with self._lock:
            return self._ready

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._watch, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                s.close()

    def _watch(self, server: socket.socket, client: socket.socket) -> None:
        """Forward the server's stream to the client, parsing its messages (type byte, int32
        length that counts itself, payload) as they pass. A chunk is counted before it is
        forwarded, so any answer a client has received is already in the counts."""
        pending, ran, late, started = b"", False, None, False
        try:
            while chunk := server.recv(65536):
                pending += chunk
                while len(pending) >= 5:
                    kind, length = pending[:1], struct.unpack("!i", pending[1:5])[0]
                    if len(pending) < 1 + length:
                        break
                    if kind == b"A" and self._late_s and late is None:
                        late = self._later(client)
                    if kind in _STATEMENT_ENDS:
                        ran = True
                    elif kind == b"Z":
                        with self._lock:
                            self._ready += started
                            started = True
                            if pending[5:6] == b"I" and ran:
                                self._count += 1
                        if pending[5:6] == b"I":
                            ran = False
                    pending = pending[1 + length :]
                if late is None:
                    client.sendall(chunk)
                else:
                    late.put((time.monotonic() + self._late_s, chunk))
        except OSError:
            pass
        finally:
            if late is not None:
                late.put((0.0, b""))  # the end, after what is still held
            else:
                client.close()
            server.close()

    @staticmethod
    def _later(client: socket.socket) -> queue.Queue:
        """A queue whose chunks reach ``client`` when due, in order; an empty chunk closes it."""
        held: queue.Queue = queue.Queue()

        def send() -> None:
            try:
                while (item := held.get())[1]:
                    time.sleep(max(item[0] - time.monotonic(), 0.0))
                    client.sendall(item[1])
            except OSError:
                pass
            finally:
                client.close()

        threading.Thread(target=send, daemon=True).start()
        return held
