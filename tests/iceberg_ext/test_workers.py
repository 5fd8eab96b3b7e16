"""`serve --workers N`: one process accepts each connection and hands it to the worker holding
the fewest; closes are counted, a killed worker is replaced and takes the next connections."""

from __future__ import annotations

import contextlib
import http.client
import os
import select
import signal
import socket
import ssl
import subprocess
import time

import psutil

from tests.iceberg_ext.catalog_server import start_server, stop_server, worker_pids


def held(supervisor: int, port: int) -> dict[int, set[int]]:
    """Each worker's open connections on ``port`` (by the client's port), as its descriptors show."""
    found = {}
    for pid in worker_pids(supervisor):
        try:
            connections = psutil.Process(pid).net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        found[pid] = {c.raddr.port for c in connections if c.raddr and c.laddr.port == port}
    return found


def counts(supervisor: int, port: int) -> dict[int, int]:
    return {pid: len(ports) for pid, ports in held(supervisor, port).items()}


def connect_together(port: int, n: int, context: ssl.SSLContext | None = None) -> list[http.client.HTTPConnection]:
    """``n`` connections opened at once (queued together before the server accepts one), each then
    answered once: when this returns, a worker holds each."""
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    connections = []
    for sock in socks:
        select.select([], [sock], [], 60)
        sock.setblocking(True)
        sock.settimeout(60)
        if context is None:
            connection = http.client.HTTPConnection("127.0.0.1", port)
            connection.sock = sock
        else:
            connection = http.client.HTTPSConnection("127.0.0.1", port, context=context)
            connection.sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        connections.append(connection)
    for connection in connections:
        connection.request("GET", "/healthz")
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 200, answer.status
    return connections


def client_port(connection: http.client.HTTPConnection) -> int:
    assert connection.sock is not None
    return connection.sock.getsockname()[1]


def wait_until(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def fewest_first(before: dict[int, int], n: int) -> list[int]:
    """The counts least-connections makes of ``before`` after ``n`` more, smallest first."""
    after = dict(before)
    for _ in range(n):
        after[min(after, key=after.__getitem__)] += 1
    return sorted(after.values())


def test_connections_go_to_the_worker_holding_fewest(lake):
    """Four connections that come together are split two and two, five times over (with one
    listening socket shared, one opening in 20 went four to one process). When one worker's
    connections close, the next go to it until the two are even again; connections answered and
    closed in between leave no count behind. A killed worker's clients are cut, a new process
    takes its place, and the next connections go to it. SIGTERM stops every process."""
    proc, uri = start_server(lake, "--workers", "2")
    port = int(uri.rsplit(":", 1)[1])
    opened: list[http.client.HTTPConnection] = []
    try:
        first, second = sorted(worker_pids(proc.pid))
        assert counts(proc.pid, port) == {first: 0, second: 0}  # the address opened with both ready
        for n in range(1, 6):
            opened += connect_together(port, 4)
            assert sorted(counts(proc.pid, port).values()) == [2 * n, 2 * n], counts(proc.pid, port)

        closing = held(proc.pid, port)[first]
        for connection in [c for c in opened if client_port(c) in closing]:
            connection.close()
            opened.remove(connection)
        wait_until(lambda: counts(proc.pid, port)[first] == 0, "the first worker's connections closed")
        opened += connect_together(port, 4)
        assert counts(proc.pid, port) == {first: 4, second: 10}

        for _ in range(50):  # answered and closed: each close is counted before its descriptor goes
            for connection in connect_together(port, 1):
                connection.close()
        wait_until(lambda: counts(proc.pid, port) == {first: 4, second: 10}, "the passing connections closed")
        opened += connect_together(port, 6)
        assert counts(proc.pid, port) == {first: 10, second: 10}

        cut = [c for c in opened if client_port(c) in held(proc.pid, port)[second]]
        os.kill(second, signal.SIGKILL)
        wait_until(lambda: len(worker_pids(proc.pid) - {first, second}) == 1, "a worker in the killed one's place")
        (third,) = worker_pids(proc.pid) - {first, second}
        for connection in cut:
            opened.remove(connection)
            connection.close()
        while counts(proc.pid, port).get(third, 0) == 0:  # until it is ready, the first takes them
            opened += connect_together(port, 1)
        before = counts(proc.pid, port)
        opened += connect_together(port, 4)
        assert sorted(counts(proc.pid, port).values()) == fewest_first(before, 4)
        assert counts(proc.pid, port)[third] == before[third] + 4
    finally:
        for connection in opened:
            connection.close()
        err = stop_server(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert f"Worker process [{second}] exited by signal SIGKILL; a new one takes its place." in err, err
    assert not any(psutil.pid_exists(p) for p in (first, third)), "a worker outlived the server"


def test_a_burst_while_both_workers_are_held_up_loses_no_connection(lake):
    """Both workers stopped (SIGSTOP: their event loops take nothing from their queues) while 700
    clients connect: each worker's queue fills (278 connections here), the supervisor holds the
    next and leaves the rest in the backlog. Resumed, every client is answered (the split is the
    machine's: a worker resumed first takes what the other's full queue cannot), and the next
    connections go to the worker holding fewer. Another server on the address fails with one line."""
    proc, uri = start_server(lake, "--workers", "2", "--max-per-token", "1000")  # all from one address
    port = int(uri.rsplit(":", 1)[1])
    pids = sorted(worker_pids(proc.pid))
    opened: list[http.client.HTTPConnection] = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        socks = []
        for _ in range(700):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            socks.append(sock)
        for sock in socks:
            select.select([], [sock], [], 60)
            sock.setblocking(True)
            sock.settimeout(60)
            connection = http.client.HTTPConnection("127.0.0.1", port)
            connection.sock = sock
            connection.request("GET", "/healthz")  # sent: it waits in the socket for a worker
            opened.append(connection)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        for connection in opened:
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200, answer.status
        before = counts(proc.pid, port)
        assert sum(before.values()) == 700 and min(before.values()) > 0, before
        opened += connect_together(port, 4)
        assert sorted(counts(proc.pid, port).values()) == fewest_first(before, 4)

        second = subprocess.run(
            ["icebarrier", "serve", "--port", str(port), "--workers", "2"],
            env={
                **os.environ,
                "ICEBARRIER_DSN": lake.settings.dsn,
                "ICEBARRIER_SCHEMA": lake.settings.schema,
                "ICEBARRIER_WAREHOUSE": lake.settings.warehouse,
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 3 and "address already in use" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr and len(second.stderr.strip().splitlines()) == 1, second.stderr
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for connection in opened:
            connection.close()
        err = stop_server(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]


def test_workers_over_tls_count_failed_handshakes_as_closed(lake, tmp_path):
    """`serve --workers 2 --tls-cert/--tls-key`: the workers make the TLS handshake of the
    connections they are handed, split two and two; plain-http clients fail the handshake and are
    counted as closed, so the next connections still go to the worker holding fewer."""
    import trustme

    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    pem = str(tmp_path / "server.pem")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    proc, uri = start_server(lake, "--workers", "2", "--tls-cert", pem, "--tls-key", pem)
    port = int(uri.rsplit(":", 1)[1])
    opened: list[http.client.HTTPConnection] = []
    try:
        first, second = sorted(worker_pids(proc.pid))
        opened += connect_together(port, 4, context)
        assert counts(proc.pid, port) == {first: 2, second: 2}
        for connection in [c for c in opened if client_port(c) in held(proc.pid, port)[first]]:
            connection.close()
            opened.remove(connection)
        wait_until(lambda: counts(proc.pid, port)[first] == 0, "the first worker's connections closed")
        for _ in range(10):  # each to the first, which holds fewer: a close not counted would tip it
            plain = socket.create_connection(("127.0.0.1", port), timeout=60)
            plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                assert plain.recv(4096) == b""  # no handshake: the worker closes it
            except ConnectionResetError:
                pass
            plain.close()
        wait_until(lambda: counts(proc.pid, port) == {first: 0, second: 2}, "the plain connections closed")
        opened += connect_together(port, 4, context)
        assert counts(proc.pid, port) == {first: 3, second: 3}
    finally:
        for connection in opened:
            connection.close()
        err = stop_server(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
