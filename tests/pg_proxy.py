"""A TCP proxy in front of Postgres that counts the round trips its clients make: every simple
query ('Q') and every extended-protocol Sync ('S', which ends one statement's Parse/Bind/Execute).
A server given the proxy's DSN talks to the real Postgres; a test reads what a request cost.

    with CountingProxy(dsn) as proxy:
        start a server with proxy.dsn ...
        before = proxy.round_trips
"""

from __future__ import annotations

import socket
import struct
import threading

import psycopg


class CountingProxy:
    def __init__(self, dsn: str) -> None:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        host, port = str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432)
        self._target = (
            (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}") if host.startswith("/") else (socket.AF_INET, (host, port))
        )
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.dsn = psycopg.conninfo.make_conninfo(
            dsn, host="127.0.0.1", port=self._listener.getsockname()[1], sslmode="disable", gssencmode="disable"
        )
        self._lock = threading.Lock()
        self._count = 0
        self._closed = False

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._count

    def __enter__(self) -> CountingProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            family, address = self._target
            upstream = socket.socket(family, socket.SOCK_STREAM)
            upstream.connect(address)
            threading.Thread(target=self._frontend, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _frontend(self, client: socket.socket, upstream: socket.socket) -> None:
        """Client to server, message by message: the startup packet (untyped), then typed ones."""
        buffer, started = b"", False
        try:
            while data := client.recv(65536):
                upstream.sendall(data)
                buffer += data
                while True:
                    if not started:
                        if len(buffer) < 4:
                            break
                        (length,) = struct.unpack("!I", buffer[:4])
                        if len(buffer) < length:
                            break
                        buffer, started = buffer[length:], True
                        continue
                    if len(buffer) < 5:
                        break
                    kind, (length,) = buffer[:1], struct.unpack("!I", buffer[1:5])
                    if len(buffer) < 1 + length:
                        break
                    if kind in (b"Q", b"S"):
                        with self._lock:
                            self._count += 1
                    buffer = buffer[1 + length :]
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
