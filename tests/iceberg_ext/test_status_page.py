"""The catalog's status page (`/ui`, rendered by a real headless chromium) and its Prometheus
metrics (`/metrics`), against a running pipeline."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import requests

from icebarrier.control_plane import barriers, jobs, leases, targets, tokens
from icebarrier.control_plane.model import JobDefinition, TableName
from tests.iceberg_ext.catalog_server import Pipeline, access_token, rest, scrape, start_server, stop_server

pytestmark = pytest.mark.slow
ARTIFACTS = Path(
    os.environ.get("ICEBARRIER_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "build" / "test-artifacts")
)


def render(chromium: str, url: str, screenshot: str, tmp_path, *, budget_ms: int, size: str):
    """Headless chromium on ``url``: the DOM once its scripts ran (``budget_ms`` of virtual time),
    and a screenshot kept in ARTIFACTS."""
    args = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--v=0",
        f"--virtual-time-budget={budget_ms}",
        f"--window-size={size}",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    subprocess.run([*args, f"--screenshot={ARTIFACTS / screenshot}", url], capture_output=True, timeout=120, check=True)
    return dom


def console_errors(dom) -> list[str]:
    """What the page logged to the browser's console, or threw."""
    return [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def test_metrics_give_each_table_its_lag_and_freshness_and_time_the_loads(lake, server):
    """By default the lake is summarized (tables by kind and target state, the stalest and most
    behind): no series per table. The tables a scrape names (a namespace, a table) get theirs:
    a table one barrier behind has lag > 0 and 1 barrier behind, a caught-up one 0; barriers
    issued count up; a pinned load shows in the load histogram under its warehouse kind; the
    garbage collector's pauses are timed."""
    p = Pipeline(lake, {"ingest": ["orders"], "late": ["late"]})
    p.advance()
    b = p.advance(only={f"{lake.namespace}_ingest"})
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    headers = {"Authorization": f"Bearer {access_token(server, cid, secret)}"}
    assert requests.get(f"{server}/metrics", timeout=30).status_code == 401
    rest(server, f"barrier-{b}", f"{cid}:{secret}").load_table(f"{lake.namespace}.orders")
    summary = scrape(server, headers)
    assert not any(name.startswith("icebarrier_table_") for name, _ in summary)  # bounded, whatever the lake
    assert summary[("icebarrier_tables", (("kind", "root"), ("target", "none")))] == 2
    assert summary[("icebarrier_tables_most_barriers_behind", (("kind", "root"),))] == 1
    orders, late = (str(lake.T(t)) for t in ("orders", "late"))
    samples = scrape(server, headers, {"namespace": orders.rsplit(".", 1)[0]})
    assert samples[("icebarrier_table_barriers_behind", (("table", orders),))] == 0
    assert samples[("icebarrier_table_lag_seconds", (("table", orders),))] == 0
    assert samples[("icebarrier_table_barriers_behind", (("table", late),))] == 1
    assert samples[("icebarrier_table_lag_seconds", (("table", late),))] > 0
    assert (
        samples[("icebarrier_table_freshness_seconds", (("table", late),))]
        > samples[("icebarrier_table_freshness_seconds", (("table", orders),))]
    )
    assert samples[("icebarrier_barriers_issued_total", ())] == 2
    assert samples[("icebarrier_catalog_load_seconds_count", (("warehouse", "barrier"),))] == 1
    # the full collection at start (what it built is frozen after it) is timed, as every one is
    assert samples[("icebarrier_catalog_gc_pause_seconds_count", (("generation", "2"),))] >= 1
    assert samples[("icebarrier_catalog_gc_pause_seconds_sum", (("generation", "2"),))] > 0
    assert not any(name.startswith("icebarrier_table_target") for name, _ in samples)  # no targets yet
    targets.set_target_lag(lake.conn, lake.T("orders"), 3600)
    targets.set_target_lag(lake.conn, lake.T("late"), 0.001)
    samples = scrape(server, headers, {"table": [orders, late]})
    assert samples[("icebarrier_tables", (("kind", "root"), ("target", "met")))] == 1
    assert samples[("icebarrier_tables", (("kind", "root"), ("target", "missed")))] == 1
    assert samples[("icebarrier_table_target_lag_seconds", (("table", orders),))] == 3600
    assert samples[("icebarrier_table_target_met", (("table", orders),))] == 1
    assert samples[("icebarrier_table_target_met", (("table", late),))] == 0
    barriers.issue(lake.conn)
    assert scrape(server, headers)[("icebarrier_barriers_issued_total", ())] == 3


def test_the_status_page_renders_the_pipeline_in_a_real_browser(lake, tmp_path):
    """Headless chromium loads /ui from a server that allows anonymous reads: the topology graph
    and the delay chart are drawn (plotly's SVG in the DOM), the tables and the lease are
    listed, the browser logs no error; a screenshot is kept as a test artifact. Without
    anonymous reads the state needs a token (the page asks for one)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here (.ci/run installs Debian's)")
    p = Pipeline(lake, {"ingest": ["orders"], "late": ["late"]})
    for _ in range(3):
        p.advance()
    p.advance(only={f"{lake.namespace}_ingest"})
    leases.acquire(lake.conn, [lake.T("orders")], ttl_s=600, holder="nightly-report")
    targets.set_target_lag(lake.conn, lake.T("orders"), 3600)
    lake.conn.execute(  # the schedule's plan, as a schedule leaves it
        "INSERT INTO schedule_state (holder, started_at, seen_at, plan) VALUES ('vm pid 1', now(), now(), %s)",
        (json.dumps([{"table": str(lake.T("orders")), "target_lag_s": 3600, "due_in_s": 3000, "jobs": ["ingest"]}]),),
    )
    proc, server = start_server(lake, "--allow-anonymous-read")
    try:
        assert requests.get(f"{server}/ui", timeout=30).status_code == 200
        dom = render(chromium, f"{server}/ui", "status-page.png", tmp_path, budget_ms=8000, size="1400,1500")
    finally:
        assert "Traceback" not in stop_server(proc)
    html = dom.stdout
    assert 'data-rendered="yes"' in html, dom.stderr[-3000:]
    for chart in ("topology", "delays", "targets"):
        block = re.search(rf'<div id="{chart}"[^>]*>(.*?)</div>\s*<div id=', html, re.S) or re.search(
            rf'<div id="{chart}"[^>]*>(.*)', html, re.S
        )
        assert 'class="main-svg"' in block.group(1), chart
    for name in ("orders", "late", "nightly-report"):
        assert f"<td>{lake.T(name) if name != 'nightly-report' else name}</td>" in html
    assert "60.0m, met" in html and "<td>50.0m</td><td>ingest</td>" in html  # a target; the plan
    assert '<div id="error"></div>' in html  # no refresh failed
    assert console_errors(dom) == []
    assert (ARTIFACTS / "status-page.png").stat().st_size > 10_000


def test_the_status_page_state_needs_a_token_without_anonymous_reads(lake, server):
    p = Pipeline(lake, {"ingest": ["orders"]})
    p.advance()
    assert requests.get(f"{server}/ui", timeout=30).status_code == 200  # the page itself holds no data
    assert requests.get(f"{server}/ui/state", timeout=30).status_code == 401
    cid, secret = tokens.create(lake.conn, whole_lake=True)
    state = requests.get(
        f"{server}/ui/state", headers={"Authorization": f"Bearer {access_token(server, cid, secret)}"}, timeout=30
    ).json()
    assert [t["table"] for t in state["tables"]] == [str(lake.T("orders"))]
    assert state["cut"]["barrier"].startswith(f"{p.marks[0]} (") and state["topology"]["data"]


def _wide_lake(lake, namespaces: int = 10, per_namespace: int = 200) -> dict:
    """2,000 jobs (10 namespaces of a DAG five deep, a tenth roots) at barrier b1, one commit per
    table; then at b2 the roots of the first namespace commit again (their readers fall behind). A
    target of an hour on the first namespace's last tables (met), of 1 ms on the second's (missed)."""
    rng = random.Random(3)
    conn, levels = lake.conn, {}
    with conn.transaction():  # one commit for all (a commit each is an fsync each)
        _register_wide(conn, rng, levels, namespaces, per_namespace)
    b1 = barriers.issue(conn).barrier
    with conn.transaction():
        for depth in range(1, 6):
            for k in range(namespaces):
                for i, name in enumerate(levels[k, depth]):
                    jobs.complete(conn, name, b1, {TableName.parse(f"lake.ns{k}.d{depth}_{i}"): 1000 * depth + i})
    b2 = barriers.issue(conn).barrier
    for i, name in enumerate(levels[0, 1]):
        jobs.complete(conn, name, b2, {TableName.parse(f"lake.ns0.d1_{i}"): 9000 + i})
    for i, _ in enumerate(levels[0, 5]):
        targets.set_target_lag(conn, TableName.parse(f"lake.ns0.d5_{i}"), 3600)
    for i, _ in enumerate(levels[1, 5]):
        targets.set_target_lag(conn, TableName.parse(f"lake.ns1.d5_{i}"), 0.001)
    return {"late": len(levels[1, 5]), "met": len(levels[0, 5]), "selected": "lake.ns0.d3_4"}


def _register_wide(conn, rng, levels: dict, namespaces: int, per_namespace: int) -> None:
    for k in range(namespaces):
        above: list[str] = []
        for depth in range(1, 6):
            count = per_namespace // 10 if depth == 1 else (per_namespace - per_namespace // 10) // 4
            level = []
            for i in range(count):
                name = f"n{k}_d{depth}_{i}"
                sources = rng.sample(above, min(len(above), rng.choice((1, 2)))) if above else []
                jobs.register(
                    conn,
                    JobDefinition(
                        name=name,
                        sources=frozenset(TableName.parse(s) for s in sources),
                        sinks=frozenset([TableName.parse(f"lake.ns{k}.d{depth}_{i}")]),
                        external_inputs=frozenset() if sources else frozenset([f"ext:{name}"]),
                    ),
                )
                level.append(f"lake.ns{k}.d{depth}_{i}")
                levels.setdefault((k, depth), []).append(name)
            above = level


@pytest.mark.slow
def test_the_status_page_reads_at_two_thousand_jobs(lake, tmp_path):
    """2,000 jobs: the state lists a page of tables (and says how many more match), counts the
    tables by state, and draws no graph until something is selected; the filters (late, a
    namespace, a search) select exactly what they name; a selected table's neighbourhood is drawn,
    bounded, coloured by target where the table has one; chromium renders it with no error (the
    screenshot is kept); a filter that does not exist is refused in one line."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    wide = _wide_lake(lake)
    proc, server = start_server(lake, "--allow-anonymous-read")
    try:

        def ui(**params) -> dict:
            r = requests.get(f"{server}/ui/state", params=params, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        whole = ui()
        assert whole["counts"]["all"] == 2000 and whole["counts"]["late"] >= wide["late"]
        assert len(whole["tables"]) == 200 and whole["more"] == 1800
        assert "choose one" in whole["topology"]["layout"]["title"]["text"]
        assert not [t for t in whole["topology"]["data"] if t.get("mode") == "markers+text"]  # no nodes
        late = ui(state="late")
        listed = {t["table"] for t in late["tables"]}  # ns1's last tables, and what feeds them (inherited targets)
        assert len(listed) == whole["counts"]["late"] and all(t.startswith("lake.ns1.") for t in listed)
        assert {f"lake.ns1.d5_{i}" for i in range(wide["late"])} <= listed
        assert {t["target_state"] for t in late["tables"]} == {"missed"}
        searched = ui(namespace="lake.ns3", q="d5_1")
        assert searched["tables"] and all(t["table"].startswith("lake.ns3.d5_1") for t in searched["tables"]), searched[
            "tables"
        ]
        near = ui(select=wide["selected"])
        nodes = [n for t in near["topology"]["data"] if t.get("mode") == "markers+text" for n in t["customdata"]]
        assert wide["selected"] in nodes and "n0_d3_4" in nodes and len(nodes) <= 150
        assert any(n.startswith("lake.ns0.d2_") for n in nodes) and any(n.startswith("lake.ns0.d5_") for n in nodes)
        by_target = [t for t in near["topology"]["data"] if t.get("name") == "table, by target"]
        assert by_target and set(by_target[0]["marker"]["color"]) == {"#2ca02c"}  # the met targets of ns0's last
        refused = requests.get(f"{server}/ui/state", params={"state": "sleepy"}, timeout=30)
        assert refused.status_code == 400 and "state 'sleepy' is not one" in refused.text
        if chromium is None:
            pytest.skip("no chromium here (.ci/run installs Debian's)")
        page = f"{server}/ui?namespace=lake.ns0&select={wide['selected']}"
        dom = render(chromium, page, "status-page-2000-jobs.png", tmp_path, budget_ms=10000, size="1400,1600")
    finally:
        assert "Traceback" not in stop_server(proc)
    html = dom.stdout
    assert 'data-rendered="yes"' in html, dom.stderr[-3000:]
    assert f"selected: {wide['selected']}" in html and 'class="on"' in html
    assert '<span class="muted" id="more"></span>' in html  # 200 tables in lake.ns0: one page, nothing more
    assert '<div id="error"></div>' in html
    assert console_errors(dom) == []
    assert (ARTIFACTS / "status-page-2000-jobs.png").stat().st_size > 10_000
