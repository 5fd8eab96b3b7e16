"""Push, not poll, through the catalog server: `job exec --follow` jobs wait on the server (a long
poll it answers when a notice concerns the job), costing Postgres nothing while nothing happens;
several server processes serve one control plane, and a killed one costs a job nothing.

(A read-committed session stays on one cut across server processes: test_catalog_server.py,
``test_read_committed_sessions_never_mix_cuts_across_two_servers``.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from icebarrier.control_plane import barriers, job_sessions, jobs, tokens
from icebarrier.control_plane.model import JobDefinition
from tests.helpers import WEEK_S
from tests.iceberg_ext.catalog_server import access_token, scrape, start_server, stop_server, worker_pids
from tests.iceberg_ext.test_job_exec import exec_args
from tests.pg_counter import TransactionCounter

pytestmark = pytest.mark.slow

CHAIN = ("root", "mid", "leaf")  # root -> t_root -> mid -> t_mid -> leaf -> t_leaf


def register_chain(lake) -> dict[str, str]:
    creds, source = {}, None
    for job in CHAIN:
        jobs.register(
            lake.conn,
            JobDefinition(
                name=job,
                sources=frozenset([lake.T(f"t_{source}")]) if source else frozenset(),
                sinks=frozenset([lake.T(f"t_{job}")]),
                external_inputs=frozenset() if source else frozenset(["ext:x"]),
            ),
        )
        creds[job] = ":".join(tokens.create(lake.conn, job=job, whole_lake=True))
        source = job
    return creds


def follow(server: str, creds: dict, tmp_path: Path, *options: str) -> dict[str, subprocess.Popen]:
    """Each job of the chain as `job exec --follow -- true` (the command writes nothing: the root
    publishes an empty barrier, the others skip)."""
    procs = {}
    for job in CHAIN:
        with open(tmp_path / f"{job}.err", "w") as err:
            procs[job] = subprocess.Popen(
                exec_args(server, creds[job], job, ["true"], "--follow", *options),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
    return procs


def wait_for(condition, what: str, procs: dict, tmp_path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for job, proc in procs.items():
            assert proc.poll() is None, f"job exec {job} exited: {(tmp_path / f'{job}.err').read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{what}: " + " | ".join(
            (tmp_path / f"{j}.err").read_text()[-500:] for j in procs
        )
        time.sleep(0.1)


def idle(lake, server: str, creds: dict) -> bool:
    """Every job of the chain has caught up with the root and the server holds all three long
    polls, waiting for a notice (a job that said "waiting for" once may since have been woken
    to bootstrap, and be running)."""
    root = jobs.show(lake.conn, "root").progress
    if root is None or any(jobs.show(lake.conn, j).progress != root for j in CHAIN):
        return False
    headers = {"Authorization": f"Bearer {access_token(server, *creds['root'].split(':'))}"}
    return scrape(server, headers)[("icebarrier_long_polls_waiting", ())] == len(CHAIN)


def kill(procs: dict) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop(procs: dict, tmp_path: Path) -> dict[str, dict]:
    summaries = {}
    for job, proc in procs.items():
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, (tmp_path / f"{job}.err").read_text()[-2000:]
        summaries[job] = json.loads(out)
    return summaries


def test_following_jobs_cost_nothing_while_idle_and_wake_when_their_source_moves(lake, tmp_path):
    """Three `job exec --follow` jobs in a chain, polling only every 5 minutes: while no barrier
    is due they cost the database at most 0.1 transactions per job per second (polling every
    second cost ~3 per job per second); each barrier then reaches the end of the chain at
    once (woken by notices, not by the poll), the control plane skipping the middle and last
    jobs as the root publishes: their processes hear nothing of those barriers. (The server
    reaches Postgres through a proxy that counts its transactions on the wire: what the jobs
    cost, and nothing else the database does.)"""
    barriers.set_interval_s(lake.conn, WEEK_S)
    creds = register_chain(lake)
    counter = TransactionCounter(lake.settings.dsn)
    server_proc, server = start_server(lake, env_extra={"ICEBARRIER_DSN": counter.dsn})
    procs = follow(server, creds, tmp_path, "--poll", "300s")
    try:
        wait_for(lambda: idle(lake, server, creds), "idle", procs, tmp_path)
        # the goal: at most 0.1 per idle job per second (polling cost ~3 per job per second). Each
        # job's long poll (--poll 300 s, up to a quarter shorter) is renewed in a burst of 3 or 4
        # transactions at most (the new poll's plan, the token's look-up, the pool's check of a
        # connection idle for long): a window of 30 s holds at most one burst per job; any polling
        # puts more in it than the budget
        assert job_sessions.MAX_WAIT_S >= 300
        before, started = counter.transactions, time.monotonic()
        time.sleep(30)
        spent, seconds = counter.transactions - before, time.monotonic() - started
        assert spent <= 2 + 0.1 * len(CHAIN) * seconds, f"{spent} transactions in {seconds:.0f} s of idle jobs"
        marks = []
        for _ in range(3):
            marks.append(barriers.issue(lake.conn).barrier)
            wait_for(
                lambda: jobs.show(lake.conn, "leaf").progress == marks[-1],
                f"barrier {marks[-1]} at the leaf",
                procs,
                tmp_path,
                timeout_s=60,
            )  # the poll alone would take 300 s
        headers = {"Authorization": f"Bearer {access_token(server, *creds['root'].split(':'))}"}
        events = {labels[0][1]: v for (name, labels), v in scrape(server, headers).items()
                  if name == "icebarrier_long_poll_events_total"}  # fmt: skip
        summaries = stop(procs, tmp_path)
    finally:
        kill(procs)  # a failed assertion leaves no job polling on
        stop_server(server_proc)
        counter.close()
    published = [s["barrier"] for s in summaries["root"]["steps"] if s["outcome"] == "published"]
    assert published[-3:] == marks  # after the barrier the clock issued for its first run
    # what the long polls cost, as /metrics says: the root woken by each barrier (a notice; its
    # clock's next barrier is a week away, and the safety net's plans on time, each job's once a
    # quarter hour, cannot bring three barriers down the chain within seconds each),
    # every job's first plan, and a heartbeat line per job in the idle 30 s (one every 20 s of waiting)
    assert events["woken"] >= len(marks), events
    assert events["planned"] >= len(CHAIN) and events["heartbeat"] >= len(CHAIN), events
    for job in ("mid", "leaf"):
        steps = summaries[job]["steps"]  # its first barrier bootstraps (runs the command); no other
        assert [s["outcome"] for s in steps] == ["published"] and steps[0]["barrier"] < marks[0], steps
        assert jobs.show(lake.conn, job).progress == marks[-1]  # skipped by the control plane


def test_serve_workers_replace_a_killed_process_and_following_jobs_keep_going(lake, tmp_path):
    """`serve --workers 2` with a chain of `job exec --follow` jobs on 1-s barriers: SIGKILL of each
    worker in turn (the long polls it held are cut) — the jobs ask again, another process (or
    the replacement) answers, and every job keeps completing barriers."""
    barriers.set_interval_s(lake.conn, 1)
    creds = register_chain(lake)
    proc, uri = start_server(lake, "--workers", "2")
    procs = {}
    try:
        deadline = time.monotonic() + 60
        while len(worker_pids(proc.pid)) < 2:
            assert time.monotonic() < deadline, "two workers did not start"
            time.sleep(0.1)
        procs = follow(uri, creds, tmp_path)
        for victim in sorted(worker_pids(proc.pid)):
            reached = jobs.show(lake.conn, "leaf").progress or 0
            wait_for(lambda: (jobs.show(lake.conn, "leaf").progress or 0) > reached, "progress", procs, tmp_path)
            os.kill(victim, signal.SIGKILL)
            reached = jobs.show(lake.conn, "leaf").progress or 0
            wait_for(
                lambda: (jobs.show(lake.conn, "leaf").progress or 0) > reached + 2_000_000,
                "progress after a killed worker",
                procs,
                tmp_path,
            )
            replaced = time.monotonic() + 60  # the supervisor reaps and replaces it on its own beat
            while victim in worker_pids(proc.pid) or len(worker_pids(proc.pid)) < 2:
                assert time.monotonic() < replaced, f"worker {victim} was not replaced: {worker_pids(proc.pid)}"
                time.sleep(0.2)
        summaries = stop(procs, tmp_path)
        procs = {}
        assert len(summaries["root"]["steps"]) >= 3  # the others bootstrap, then the control plane skips them
        assert {jobs.show(lake.conn, j).progress for j in CHAIN} == {jobs.show(lake.conn, "root").progress}
    finally:
        for p in procs.values():
            p.kill()
        err = stop_server(proc)
    assert "Traceback" not in err, err[-3000:]


def test_sigterm_answers_the_long_polls_and_jobs_carry_on_with_the_next_server(lake, tmp_path):
    """SIGTERM of a server holding three jobs' long polls: it answers each at once (no request is
    left for its grace period to cut off), says it is not ready, and exits; the jobs ask again,
    wait for the next server on the same address, and complete every barrier issued once."""
    barriers.set_interval_s(lake.conn, WEEK_S)
    creds = register_chain(lake)
    grace = "120s"  # a long poll held to the grace would show as the grace, and in uvicorn's log
    first, uri = start_server(lake, "--shutdown-grace", grace)
    port = int(uri.rsplit(":", 1)[1])
    procs = follow(uri, creds, tmp_path, "--poll", "300s")
    second = None
    try:
        wait_for(lambda: idle(lake, uri, creds), "idle", procs, tmp_path)
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)  # well inside the grace: nothing waited for it
        # uvicorn ends by raising the signal it handled again: exit "by SIGTERM", after draining
        assert first.returncode == -signal.SIGTERM, (first.returncode, err)
        assert "graceful shutdown exceeded" not in err and "Traceback" not in err, err
        second, _ = start_server(lake, port=port)
        wait_for(lambda: idle(lake, uri, creds), "waiting on the next server", procs, tmp_path)
        marks = []
        for _ in range(2):
            marks.append(barriers.issue(lake.conn).barrier)
            wait_for(
                lambda: jobs.show(lake.conn, "leaf").progress == marks[-1], "the leaf", procs, tmp_path, timeout_s=90
            )
        summaries = stop(procs, tmp_path)
    finally:
        kill(procs)
        if second is not None:
            stop_server(second)
    published = [s["barrier"] for s in summaries["root"]["steps"] if s["outcome"] == "published"]
    assert published[-2:] == marks and len(published) == len(set(published))  # each once
    for job in ("mid", "leaf"):
        assert jobs.show(lake.conn, job).progress == marks[-1]
        assert len(summaries[job]["steps"]) == 1  # its bootstrap: the control plane skipped the rest


def test_a_renewal_with_nothing_new_plans_nothing_and_one_after_a_move_plans(lake):
    """A long poll that ends with nothing new stays watched on the server: the job's next ask,
    if nothing concerning it happened meanwhile, waits on without planning — one transaction, the
    token's look-up (planning again costs more). A source that moves between two asks is not
    missed: the next ask plans, and finds the barrier ready."""
    from icebarrier.apps.job_exec import SessionClient

    barriers.set_interval_s(lake.conn, WEEK_S)
    creds = register_chain(lake)
    counter = TransactionCounter(lake.settings.dsn)
    env = {"ICEBARRIER_DSN": counter.dsn, "ICEBARRIER_POOL_CHECK_IDLE": "1h"}  # no pings between asks
    server_proc, server = start_server(lake, env_extra=env)
    try:
        mid, root = SessionClient(server, creds["mid"]), SessionClient(server, creds["root"])

        def ask(client: SessionClient, job: str, wait_s: float = 1.0) -> dict:
            return client.open(job, skip=True, coalesce=True, hold_s=60, wait_s=wait_s)

        assert not ask(mid, "mid")["ready"]  # t_root has nothing yet
        before = counter.transactions
        for _ in range(5):
            assert not ask(mid, "mid")["ready"]
        assert counter.transactions - before <= 5, f"{counter.transactions - before} transactions for 5 renewals"

        barriers.issue(lake.conn)
        opened = ask(root, "root", wait_s=0)
        assert opened["ready"], opened
        root.publish("root", opened["session"]["run_id"])  # t_root moves while mid's poll is kept
        answer = ask(mid, "mid")
        assert answer["ready"] and answer["session"]["barrier"] == opened["session"]["barrier"], answer
    finally:
        err = stop_server(server_proc)
        counter.close()
    assert "Traceback" not in err, err[-3000:]


def test_serve_heartbeat_says_how_often_a_waiting_long_poll_speaks(lake):
    """`serve --heartbeat 1s`: a long poll with nothing to do says what its job waits for at once,
    then every second (the default, 20 s, is for proxies' idle timeouts; a longer one where none
    cuts idle connections sooner saves the server a line's CPU), each line read as it comes.
    (Broken on purpose, the option ignored, a 4.5-s poll hears one line.)"""
    from icebarrier.apps.job_exec import SessionClient

    barriers.set_interval_s(lake.conn, WEEK_S)
    creds = register_chain(lake)
    server_proc, server = start_server(lake, "--heartbeat", "1s")
    try:
        lines: list[dict] = []
        mid = SessionClient(server, creds["mid"])
        answer = mid.open("mid", skip=True, coalesce=True, hold_s=60, wait_s=4.5, on_line=lines.append)
        assert not answer["ready"], answer
        assert len([line for line in lines if "waiting" in line]) >= 3, lines  # at 0, 1, 2, 3 and 4 s
    finally:
        err = stop_server(server_proc)
    assert "Traceback" not in err, err[-3000:]


def test_a_long_poll_whose_token_is_revoked_while_it_waits_opens_nothing(lake):
    """mid waits in a long poll; its token is revoked; then its source moves. The wake plans in a
    transaction that checks the token again: the stream ends with the refusal, and mid has no
    session. (Broken on purpose, without that check, the revoked token's poll opened one.)"""
    import threading

    from icebarrier.apps.job_exec import CatalogRequestError, SessionClient

    barriers.set_interval_s(lake.conn, WEEK_S)
    creds = register_chain(lake)
    server_proc, server = start_server(lake)
    try:
        mid, root = SessionClient(server, creds["mid"]), SessionClient(server, creds["root"])
        answers: list = []

        def wait() -> None:
            try:
                answers.append(mid.open("mid", skip=True, coalesce=True, hold_s=60, wait_s=30))
            except CatalogRequestError as exc:
                answers.append(exc)

        waiting = threading.Thread(target=wait)
        waiting.start()
        time.sleep(1.0)  # mid's poll is waiting
        tokens.revoke(lake.conn, creds["mid"].split(":", 1)[0])
        barriers.issue(lake.conn)
        opened = root.open("root", skip=True, coalesce=True, hold_s=60, wait_s=0)
        root.publish("root", opened["session"]["run_id"])  # t_root moves: mid wakes
        waiting.join(20)
        assert not waiting.is_alive()
        [answer] = answers
        assert isinstance(answer, CatalogRequestError) and answer.status == 401, answer
        assert job_sessions.get(lake.conn, "mid") is None
    finally:
        err = stop_server(server_proc)
    assert "Traceback" not in err, err[-3000:]


def test_a_waiting_job_holds_a_live_token_all_along_where_tokens_live_less_than_its_poll(lake, tmp_path):
    """`serve --token-ttl 1m`, mid `job exec --follow` (long polls of up to an hour): each long
    poll is sent with a token that outlives it, so it ends before its token does (45 s) and the
    next takes a new one. Woken after 75 s, mid plans with a live token and runs. (Broken on
    purpose, the poll kept for an hour: its token expired at 60 s, the wake was refused with a 401
    and mid took its second token only then.)"""
    from datetime import datetime

    from icebarrier.apps.job_exec import SessionClient

    barriers.set_interval_s(lake.conn, WEEK_S)
    creds = register_chain(lake)
    server_proc, server = start_server(lake, "--token-ttl", "1m", "--log-format", "json")
    with open(tmp_path / "mid.err", "w") as err:
        procs = {
            "mid": subprocess.Popen(
                exec_args(server, creds["mid"], "mid", ["true"], "--follow"),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        }
    try:
        time.sleep(75)
        woken = datetime.now().astimezone()
        marked = barriers.issue(lake.conn).barrier
        root = SessionClient(server, creds["root"])
        root.publish("root", root.open("root", skip=True, coalesce=True, hold_s=60)["session"]["run_id"])
        wait_for(lambda: jobs.show(lake.conn, "mid").progress == marked, "mid runs the barrier", procs, tmp_path)
        summary = stop(procs, tmp_path)["mid"]
    finally:
        kill(procs)
        err = stop_server(server_proc)
    assert "Traceback" not in err, err[-3000:]
    assert [s["outcome"] for s in summary["steps"]] == ["published"], summary
    log = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    asked = [datetime.fromisoformat(e["ts"]) for e in log if e["route"] == "/v1/oauth/tokens"]
    held = [t for t in asked if t < woken] + [woken]  # mid's tokens (root's came after)
    gaps = [(b - a).total_seconds() for a, b in zip(held, held[1:], strict=False)]
    assert len(held) >= 3 and max(gaps) < 60, f"mid's tokens {gaps} s apart, then woken: one expired meanwhile"
