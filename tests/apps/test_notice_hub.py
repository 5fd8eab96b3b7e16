"""The server's notice hub (apps/catalog/notices.py) on a real listener: a request that is still
planning loses no notice for what it will wait for, and is not handed the others."""

from __future__ import annotations

import asyncio
import time

from icebarrier.apps.catalog import notices as hub_module
from icebarrier.apps.catalog.notices import Hub
from icebarrier.control_plane import barriers, inputs, jobs
from icebarrier.control_plane.notices import Wait
from tests.helpers import T, job, new_barrier, register_chain


async def _delivered(hub: Hub, at_least: int) -> None:
    for _ in range(100):
        if hub.seq >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the hub heard {hub.seq} notices, not {at_least}")


def _waits_for(table: str, barrier: int, progress: int) -> Wait:
    return Wait(tables={table: progress}, target=barrier, progress=progress, due_at=float("inf"))


def _both_sources_at_a_barrier(conn) -> int:
    """The chain's two root tables completed at a barrier B0 (what the waits plan from); B0."""
    register_chain(conn)
    b0 = new_barrier(conn)
    jobs.complete(conn, "ingest_orders", b0, {T("orders"): 1})
    jobs.complete(conn, "ingest_payments", b0, {T("payments"): 2})
    return b0


def _run(dsn: str, scenario) -> None:
    async def main():
        hub = Hub(dsn, None)
        hub.start()
        try:
            await scenario(hub)
        finally:
            hub.stop()

    asyncio.run(main())


def test_a_notice_that_comes_while_a_request_plans_wakes_the_wait_it_then_holds(conn, dsn):
    """Watches taken before a plan, notices for one table meanwhile: the wait on that table wakes
    when held, the wait on another does not (and neither was routed anything while planning)."""
    b0 = _both_sources_at_a_barrier(conn)

    async def scenario(hub: Hub):
        await asyncio.sleep(0.3)
        planning = [hub.watch(), hub.watch()]
        b1 = new_barrier(conn)
        jobs.complete(conn, "ingest_orders", b1, {T("orders"): 3})  # orders moves; payments does not
        await _delivered(hub, 2)  # the barrier, then the watermark
        assert not any(w.waiting for w in planning) and hub.waiting == 0
        on_orders, on_payments = planning
        on_orders.hold(_waits_for(str(T("orders")), b1, b0))
        on_payments.hold(_waits_for(str(T("payments")), b1, b0))
        assert on_orders.woken and not on_payments.woken
        jobs.complete(conn, "ingest_payments", b1, {T("payments"): 4})  # now it moves, held: routed at once
        await _delivered(hub, 3)
        assert on_payments.woken

    _run(dsn, scenario)


def test_a_request_that_plans_longer_than_notices_are_kept_plans_again(conn, dsn, monkeypatch):
    """Notices are kept RECENT_S; a wait held after some were forgotten is woken (it plans again
    rather than miss one), even when what was forgotten did not concern it."""
    monkeypatch.setattr(hub_module, "RECENT_S", 0.0)
    b0 = _both_sources_at_a_barrier(conn)

    async def scenario(hub: Hub):
        await asyncio.sleep(0.3)
        slow = hub.watch()
        new_barrier(conn)
        await _delivered(hub, 1)
        fresh = hub.watch()
        new_barrier(conn)  # its delivery forgets the first barrier's notice
        await _delivered(hub, 2)
        slow.hold(_waits_for(str(T("payments")), 99, b0))
        fresh.hold(_waits_for(str(T("payments")), 99, b0))
        assert slow.woken, "a wait that may have missed a notice plans again"
        assert not fresh.woken, "only what was forgotten since its watch began counts"

    _run(dsn, scenario)


def test_a_wait_stays_held_between_heartbeats_and_is_released_when_woken_or_due(conn, dsn):
    """A long poll's wait ended by a heartbeat stays held (nothing routed again, nothing replayed):
    a notice while the heartbeat line is said wakes the next wait at once, which releases it (its
    request plans again); a wait past its due time is released too."""
    b0 = _both_sources_at_a_barrier(conn)

    async def scenario(hub: Hub):
        await asyncio.sleep(0.3)
        b1 = new_barrier(conn)
        await _delivered(hub, 1)
        watch, wait = hub.watch(), _waits_for(str(T("orders")), b1, b0)
        assert await watch.until(wait, limit_s=0.1) is False  # a heartbeat
        assert watch.waiting and hub.waiting == 1
        jobs.complete(conn, "ingest_orders", b1, {T("orders"): 3})  # while the line is said
        await _delivered(hub, 2)
        assert await watch.until(wait, limit_s=0.1) is True
        assert not watch.waiting and hub.waiting == 0
        due = _waits_for(str(T("payments")), b1, b0)
        due.due_at = 0.0
        assert await watch.until(due, limit_s=5) is False
        assert not watch.waiting

    _run(dsn, scenario)


def test_an_announcement_brings_a_waiting_root_jobs_due_time_nearer_without_waking_it(conn, dsn):
    """A root job waits for an announcement, due at no clock, through a heartbeat's wait of 30 s.
    An announcement saying the next barrier is due in about a second ends that wait at its new
    due time, not woken (not at once: that plan would find nothing; not in 30 s: no barrier
    would come if nobody else issued it). Announced again, a barrier issued before that time
    wakes the wait by its notice."""
    jobs.register(conn, job("root", sinks=["r"], external=["in:x"]))
    inputs.announce(conn, ["in:x"])
    b0 = new_barrier(conn)
    jobs.complete(conn, "root", b0, {T("r"): 1})
    barriers.set_interval_s(conn, 1.5)

    def waiting_for_an_announcement() -> Wait:
        wait = Wait.of(jobs.next_barrier(conn, "root"), root=True, due_in_s=None, safety_s=float("inf"))
        assert wait.announced == {"in:x"}
        return wait

    async def scenario(hub: Hub):
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        watch, wait, started = hub.watch(), waiting_for_an_announcement(), loop.time()
        waiting = asyncio.ensure_future(watch.until(wait, limit_s=30.0))
        await asyncio.sleep(0.2)
        inputs.announce(conn, ["in:x"])
        assert await waiting is False  # due, not woken
        assert 0.5 < loop.time() - started < 5.0
        jobs.complete(conn, "root", new_barrier(conn), {T("r"): 2})  # the job runs it (by hand here)
        barriers.set_interval_s(conn, 30)
        watch, wait = hub.watch(), waiting_for_an_announcement()
        waiting = asyncio.ensure_future(watch.until(wait, limit_s=30.0))
        await asyncio.sleep(0.2)
        inputs.announce(conn, ["in:x"])
        await asyncio.sleep(0.3)
        assert not waiting.done()
        new_barrier(conn)
        assert await asyncio.wait_for(waiting, 5.0) is True  # the barrier's notice

    _run(dsn, scenario)


def test_long_polls_that_planned_together_are_due_again_apart():
    """The safety net's due time is each job's own point of every REPLAN_S (a hash of its name):
    2,000 long polls that planned in the same second (a server restarted, and they plan again on
    the notices of the catch-up) are due again spread over REPLAN_S from the start, as in a
    steady state, not in a wave; a job that plans again when due is due a whole REPLAN_S later.
    (Broken on purpose, REPLAN_S less up to a quarter at random as before: 563 in a minute.)"""
    cycle, now = hub_module.REPLAN_S, time.time()
    due = [hub_module.replan_s(f"job_{i}", now) for i in range(2000)]
    assert all(0 <= d <= cycle + 1 for d in due)
    in_a_minute = max(sum(1 for d in due if s <= d < s + 60) for s in range(0, 841, 10))
    assert in_a_minute < 250, in_a_minute  # ~133 a minute on average; all 2,000 together
    for name, d in zip(["job_0", "job_1", "job_2"], due, strict=False):
        assert abs(hub_module.replan_s(name, now + d) - cycle) < 1e-3
