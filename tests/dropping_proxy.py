"""A small HTTP proxy for retry tests: it forwards each request to the server and answers the
client with the server's response, except for requests chosen to be dropped: those are
forwarded, the server's whole response is read (the server has acted), and the client's
connection is closed without an answer, as a network failure after the request would."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    dropped: bool
    status: int | None = None


@dataclass
class DroppingProxy:
    upstream: str
    drop: Callable[[str, str, dict], bool] = lambda method, path, headers: False  # whether to drop this one
    add_headers: Callable[[str, str], dict] = lambda method, path: {}
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        target = urlsplit(self.upstream)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
                headers.update(proxy.add_headers(self.command, self.path))
                dropped = proxy.drop(self.command, self.path, headers)
                seen = Seen(self.command, self.path, headers, body, dropped)
                proxy.seen.append(seen)
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    content = response.read()
                finally:
                    upstream.close()
                seen.status = response.status
                if dropped:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
