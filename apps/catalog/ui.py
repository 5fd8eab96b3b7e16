"""The status page, ``GET /ui``: a live picture of the pipeline (read-only), at any size.

``/ui`` is one HTML page; it polls ``/ui/state`` (every 2 s) and draws with plotly.js, served
from the installed ``plotly`` package at ``/ui/plotly.min.js`` (no CDN). What it shows is what
its filters select, so a lake of 2,000 jobs and 100,000 tables reads as well as one of five
(the filters are the page's address: a view is a link): ``namespace`` (the tables under it),
``state`` (``late``: missing or at risk of missing its target lag; ``failing``: its writer lost
or its last scheduled run failed; ``running``: its writer at work), ``q`` (a part of a table's or
its writer's name), ``select`` (a table or a job: the graph draws its neighbourhood).

The state holds: the tables by state (the filter's counts) and the largest namespaces; the
selected tables, :data:`ROWS` at most (how many more match is said), with watermark, freshness,
target lag, coalesced range, maintenance's last action and what comes next; the topology of the
neighbourhood of what is selected (:data:`RADIUS` steps up and down, :data:`MAX_NODES` nodes at
most; with no selection, of the selected tables when they are few), tables coloured by their
target (met, at risk, missed) where they have one and by barriers behind where they have none;
the delay of their writers over the recent barriers and their freshness against target lag; the
schedule's next planned runs, active leases and the read-committed cut.

The state needs a reader (or job) token, like any catalog read, unless the server allows
anonymous reads; the page asks for CLIENT_ID:SECRET when it gets a 401 and keeps the access
token in the browser tab's session storage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from icebarrier.apps.catalog.deps import Caller, LakeDep
from icebarrier.control_plane.errors import InvalidValueError
from icebarrier.control_plane.model import barrier_label, format_duration_s
from icebarrier.control_plane.targets import target_state_sql

router = APIRouter(prefix="/ui")
PAGE = Path(__file__).with_name("ui.html")
RECENT_BARRIERS = 60
TARGET_WINDOW_S = 600  # the freshness chart's span
ROWS = 200  # tables listed at most
RADIUS = 4  # the neighbourhood drawn: this many steps (table -> job -> table …) up and down
MAX_NODES = 150  # nodes drawn at most
UNSELECTED_GRAPH = 40  # with no selection, the graph draws the neighbourhood of this many tables at most
CHARTED = 12  # jobs in the delay chart, tables in the freshness chart, at most
STATES = ("all", "late", "failing", "running")
COLOURS = {"met": "#2ca02c", "at_risk": "#ffbf00", "missed": "#d62728"}


@dataclass(frozen=True, slots=True)
class View:
    """What the page selects (its address's query)."""

    namespace: str | None = None
    state: str = "all"
    q: str | None = None
    select: str | None = None

    @classmethod
    def of(cls, params) -> View:
        state = params.get("state") or "all"
        if state not in STATES:
            raise InvalidValueError(
                f"state {state!r} is not one the status page filters by; use one of {', '.join(STATES)}"
            )
        return cls(
            namespace=params.get("namespace") or None,
            state=state,
            q=params.get("q") or None,
            select=params.get("select") or None,
        )


def layers(edges: list[tuple[str, str]], nodes: list[str]) -> dict[str, tuple[int, int]]:
    """(layer, row) per node: a node's layer is the longest path to it from a node nobody feeds."""
    feeds: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        feeds.setdefault(b, []).append(a)
    depth: dict[str, int] = {}

    def of(node: str, seen: frozenset = frozenset()) -> int:
        if node not in depth:
            depth[node] = (
                0 if node in seen else 1 + max((of(f, seen | {node}) for f in feeds.get(node, [])), default=-1)
            )
        return depth[node]

    placed: dict[str, tuple[int, int]] = {}
    for layer in sorted({of(n) for n in nodes}):  # each layer ordered by where its feeders sit (fewer crossings)
        here = [n for n in nodes if of(n) == layer]
        rank = {
            n: sum(placed[f][1] for f in feeds.get(n, []) if f in placed)
            / max(1, sum(f in placed for f in feeds.get(n, [])))
            for n in here
        }
        for row, node in enumerate(sorted(here, key=lambda n: (rank[n], n))):
            placed[node] = (layer, row)
    return placed


def topology_figure(edges: list[dict], tables: dict[str, dict], *, title: str, selected: str | None = None) -> dict:
    """The layered graph of ``edges``; a table coloured by its target's state where it has one,
    else by the barriers it is behind; ``selected`` drawn larger."""
    import plotly.graph_objects as go

    pairs = [(e["from_node"], e["to_node"]) for e in edges]
    kinds = {e["from_node"]: e["from_kind"] for e in edges} | {e["to_node"]: e["to_kind"] for e in edges}
    kinds |= {t: "table" for t in tables}
    at = layers(pairs, sorted(kinds))
    fig = go.Figure()
    xs, ys = [], []
    for a, b in pairs:
        xs += [at[a][0], at[b][0], None]
        ys += [-at[a][1], -at[b][1], None]
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="lines",
            line={"color": "#999", "width": 1},
            hoverinfo="skip",
            showlegend=False,
            name="edges",
        )
    )

    def info(n: str) -> dict:
        return tables.get(n, {"barriers_behind": 0, "freshness": "?", "target_state": "none", "target": "none"})

    groups = (
        ("external", "diamond", lambda n: kinds[n] == "external"),
        ("job", "square", lambda n: kinds[n] == "job"),
        ("table, by target", "circle", lambda n: kinds[n] == "table" and info(n)["target_state"] != "none"),
        ("table, by barriers behind", "circle", lambda n: kinds[n] == "table" and info(n)["target_state"] == "none"),
    )
    for label, symbol, member in groups:
        names = [n for n in sorted(kinds) if member(n)]
        if not names:
            continue
        sizes = [26 if n == selected else 16 for n in names]
        marker: dict = {"symbol": symbol, "size": sizes, "line": {"width": [3 if n == selected else 0 for n in names]}}
        if label == "table, by target":
            marker["color"] = [COLOURS[info(n)["target_state"]] for n in names]
        elif label == "table, by barriers behind":
            behind = [info(n)["barriers_behind"] for n in names]
            marker |= {
                "color": behind,
                "colorscale": [[0, "#2ca02c"], [0.5, "#ffbf00"], [1, "#d62728"]],
                "cmin": 0,
                "cmax": max(4, *behind),
                "showscale": True,
                "colorbar": {"title": {"text": "barriers behind"}},
            }
        else:
            marker["color"] = "#1f77b4" if label == "job" else "#7f7f7f"
        text = [
            n
            if kinds[n] != "table"
            else f"{n}<br>behind {info(n)['barriers_behind']} barrier(s), fresh {info(n)['freshness']}, "
            f"target {info(n)['target']}"
            for n in names
        ]
        fig.add_trace(
            go.Scatter(
                x=[at[n][0] for n in names],
                y=[-at[n][1] for n in names],
                mode="markers+text",
                text=[n.split(".")[-1] for n in names],
                customdata=names,
                textposition="top center",
                hovertext=text,
                hoverinfo="text",
                marker=marker,
                name=label,
            )
        )
    fig.update_layout(
        title={"text": title},
        xaxis={"visible": False},
        yaxis={"visible": False},
        margin={"l": 10, "r": 10, "t": 40, "b": 10},
        height=min(1200, max(360, 28 * (1 + max((r for _, r in at.values()), default=0)))),
        legend={"orientation": "h", "y": -0.05},
    )
    return json.loads(fig.to_json())


def delay_figure(delays: list[dict]) -> dict:
    import plotly.graph_objects as go

    fig = go.Figure()
    for job in sorted({d["job_name"] for d in delays}):
        mine = [d for d in delays if d["job_name"] == job]
        fig.add_trace(
            go.Scatter(x=[d["issued_at"] for d in mine], y=[d["delay_s"] for d in mine], mode="lines+markers", name=job)
        )
    fig.update_layout(
        title={"text": f"Job delay over the last {RECENT_BARRIERS} barriers (s)"},
        yaxis={"title": {"text": "seconds"}, "rangemode": "tozero"},
        margin={"l": 50, "r": 10, "t": 40, "b": 40},
        height=300,
    )
    return json.loads(fig.to_json())


def freshness_points(completions: list[dict], now: datetime) -> tuple[list[str], list[float]]:
    """A table's freshness over time from its completions (oldest first): it grows from one
    completion to the next, then drops to the age of the barrier completed."""
    xs: list[str] = []
    ys: list[float] = []
    for before, c in zip([None, *completions], completions):
        if before is not None:
            xs.append(c["completed_at"].isoformat())
            ys.append((c["completed_at"] - before["issued_at"]).total_seconds())
        xs.append(c["completed_at"].isoformat())
        ys.append((c["completed_at"] - c["issued_at"]).total_seconds())
    if completions:
        xs.append(now.isoformat())
        ys.append((now - completions[-1]["issued_at"]).total_seconds())
    return xs, ys


def targets_figure(targeted: dict[str, float], completions: list[dict], now: datetime) -> dict:
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, (table, target_s) in enumerate(sorted(targeted.items())):
        xs, ys = freshness_points([c for c in completions if c["table_name"] == table], now)
        color = f"hsl({(i * 67) % 360}, 60%, 40%)"
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{table} freshness", line={"color": color}))
        if xs:
            fig.add_trace(
                go.Scatter(
                    x=[xs[0], xs[-1]],
                    y=[target_s, target_s],
                    mode="lines",
                    name=f"{table} target",
                    line={"color": color, "dash": "dash"},
                )
            )
    fig.update_layout(
        title={"text": f"Freshness against target lag, last {TARGET_WINDOW_S // 60} minutes (s)"},
        yaxis={"title": {"text": "seconds"}, "rangemode": "tozero"},
        margin={"l": 50, "r": 10, "t": 40, "b": 40},
        height=300,
    )
    return json.loads(fig.to_json())


def _target_text(r: dict) -> str:
    if r["effective_s"] is None:
        return "none"
    inherited = "" if r["target_from"] == r["table_name"] else f" (from {r['target_from']})"
    return f"{format_duration_s(r['effective_s'])}{inherited}, {'met' if r['target_met'] else 'MISSED'}"


def schedule_state(row: dict | None) -> dict:
    if row is None:
        return {"holder": "(no schedule has run)", "plan": []}
    return {
        "holder": f"(schedule {row['holder']}, seen {row['seen_at']:%H:%M:%S})",
        "plan": [
            {
                "table": d["table"],
                "target": format_duration_s(d["target_lag_s"]),
                "due_in": "now" if d["due_in_s"] is None or d["due_in_s"] <= 0 else format_duration_s(d["due_in_s"]),
                "runs": " -> ".join(d["jobs"]),
            }
            for d in row["plan"]
        ],
    }


def maintenance_text(r: dict | None, now: datetime) -> dict[str, str]:
    """A table's maintenance on the page: its newest action (what, result, how long ago) and
    what comes next."""
    if r is None or not r["enabled"]:
        return {"maintained_last": "off", "maintained_next": "-"}
    if r["checked_at"] is None:
        return {"maintained_last": "not looked at yet", "maintained_next": "-"}
    last = "none yet"
    if r["actions"]:
        action, newest = max(r["actions"].items(), key=lambda a: a[1]["at"])
        age = (now - datetime.fromisoformat(newest["at"])).total_seconds()
        last = f"{action} {newest['result']}, {format_duration_s(age)} ago"
    return {"maintained_last": last, "maintained_next": r["next"]}


# every managed table in a few columns, each with what the filters look at (a writer's state
# once per job, not once per sink: 100,000 tables are written by a few thousand jobs)
_TABLES = f"""
WITH w AS (
    SELECT j.job_id, j.name,
           (j.status = 'running' AND j.heartbeat_at < now() - interval '90 seconds')
           OR (SELECT r.exit_code <> 0 FROM schedule_run r WHERE r.job_name = j.name AND r.finished_at IS NOT NULL
               ORDER BY r.started_at DESC LIMIT 1) AS failing,
           EXISTS (SELECT 1 FROM job_session s WHERE s.job_name = j.name AND s.held_until > now())
           OR EXISTS (SELECT 1 FROM schedule_run r WHERE r.job_name = j.name AND r.finished_at IS NULL)
           OR (j.status = 'running' AND j.heartbeat_at >= now() - interval '90 seconds'
               AND j.waiting_for IS NULL) AS running
    FROM job j WHERE j.active
), t AS (
    SELECT m.table_id, m.name, w.name AS writer,
           {target_state_sql("now() - b.issued_at", "tt.effective_target_lag")} AS target_state,
           w.failing, w.running
    FROM managed_table m
    LEFT JOIN job_sink k ON k.table_id = m.table_id
    LEFT JOIN w ON w.job_id = k.job_id
    LEFT JOIN barrier b ON b.barrier = m.watermark
    LEFT JOIN targeted_tables tt ON tt.table_id = m.table_id
    WHERE (%(namespace)s::text IS NULL OR starts_with(m.name, %(namespace)s || '.'))
      AND (%(q)s::text IS NULL OR strpos(m.name, %(q)s) > 0 OR strpos(w.name, %(q)s) > 0)
), picked AS (
    SELECT *, target_state IN ('missed', 'at_risk') AS late FROM t
)
"""
COUNTS = (
    _TABLES
    + """
SELECT count(*) AS all, count(*) FILTER (WHERE late) AS late, count(*) FILTER (WHERE failing) AS failing,
       count(*) FILTER (WHERE running) AS running
FROM picked
"""
)
LISTED = (
    _TABLES
    + """
SELECT v.table_name, v.table_kind, v.writer_job, v.watermark_barrier, v.current_snapshot_id,
       extract(epoch FROM v.freshness) AS freshness_s, v.barriers_behind, v.coalesced_after, v.coalesced_into,
       extract(epoch FROM v.effective_target_lag) AS effective_s, v.target_from, v.target_met, p.target_state
FROM (SELECT * FROM picked WHERE {state} ORDER BY name LIMIT %(rows)s) p
JOIN table_versions v ON v.table_name = p.name
ORDER BY v.table_name
"""
)
NAMESPACES = """
SELECT regexp_replace(name, '\\.(`([^`]|``)*`|[^.`]*)$', '') AS namespace, count(*) AS tables
FROM managed_table GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 50
"""
# the edges within RADIUS steps of the start nodes, up and down
NEIGHBOURHOOD = """
WITH RECURSIVE up(node, d) AS (
    SELECT unnest(%(start)s::text[]), 0
    UNION SELECT e.from_node, up.d + 1 FROM topology_edges e JOIN up ON e.to_node = up.node WHERE up.d < %(radius)s
), down(node, d) AS (
    SELECT unnest(%(start)s::text[]), 0
    UNION SELECT e.to_node, down.d + 1 FROM topology_edges e JOIN down ON e.from_node = down.node
    WHERE down.d < %(radius)s
), near AS (
    SELECT node, min(d) AS d FROM (SELECT * FROM up UNION ALL SELECT * FROM down) x GROUP BY node
    ORDER BY min(d), node LIMIT %(nodes)s
)
SELECT e.from_node, e.to_node, e.edge_kind, e.from_kind, e.to_kind
FROM topology_edges e
WHERE e.from_node IN (SELECT node FROM near) AND e.to_node IN (SELECT node FROM near)
ORDER BY 1, 2
"""
_STATE_FILTER = {"all": "true", "late": "late", "failing": "failing", "running": "running"}


def state(conn, view: View = View()) -> dict:
    """What the page shows for ``view``, read in one transaction."""
    params = {"namespace": view.namespace, "q": view.q, "rows": ROWS + 1}
    with conn.transaction():
        counts = conn.execute(COUNTS, params).fetchone()
        rows = conn.execute(LISTED.format(state=_STATE_FILTER[view.state]), params).fetchall()
        more = len(rows) > ROWS
        rows = rows[:ROWS]
        namespaces = conn.execute(NAMESPACES).fetchall()
        start = [view.select] if view.select else [r["table_name"] for r in rows][: UNSELECTED_GRAPH + 1]
        graphed = bool(start) and len(start) <= UNSELECTED_GRAPH
        edges = (
            conn.execute(
                NEIGHBOURHOOD, {"start": start, "radius": RADIUS if view.select else 1, "nodes": MAX_NODES}
            ).fetchall()
            if graphed
            else []
        )
        drawn = {e[k] for e in edges for k in ("from_node", "to_node")} | (set(start) if graphed else set())
        shown = {r["table_name"]: r for r in rows}  # the tables listed, and those drawn beside them
        if unlisted := sorted(drawn - shown.keys()):
            shown |= {
                r["table_name"]: r
                for r in conn.execute(
                    LISTED.format(state="name = ANY(%(drawn)s::text[])"),
                    {**params, "namespace": None, "q": None, "drawn": unlisted, "rows": MAX_NODES},
                ).fetchall()
            }
        now = conn.execute("SELECT now() AS now").fetchone()["now"]
        charted = sorted(shown, key=lambda n: (n not in drawn, n))  # what the graph draws first
        targeted = {n: float(shown[n]["effective_s"]) for n in charted if shown[n]["effective_s"] is not None}
        targeted = dict(list(targeted.items())[:CHARTED])
        completions = conn.execute(
            "SELECT table_name, issued_at, completed_at FROM barrier_delay WHERE table_name = ANY(%s) "
            "AND completed_at > now() - make_interval(secs => %s) ORDER BY table_name, completed_at",
            (list(targeted), TARGET_WINDOW_S),
        ).fetchall()
        writers = list(dict.fromkeys(shown[n]["writer_job"] for n in charted if shown[n]["writer_job"]))[:CHARTED]
        schedule = conn.execute("SELECT holder, seen_at, plan FROM schedule_plan").fetchone()
        delays = conn.execute(
            "SELECT job_name, barrier, issued_at, extract(epoch FROM delay) AS delay_s FROM job_delay "
            "WHERE job_name = ANY(%s) AND barrier >= coalesce((SELECT min(barrier) FROM (SELECT barrier FROM barrier "
            "ORDER BY barrier DESC LIMIT %s) r), 0) ORDER BY issued_at",
            (writers, RECENT_BARRIERS),
        ).fetchall()
        leases = conn.execute(
            "SELECT lease_id::text, holder, table_name, snapshot_id, barrier, expires_at "
            "FROM active_leases ORDER BY expires_at, table_name LIMIT %s",
            (ROWS,),
        ).fetchall()
        cut = conn.execute(
            "SELECT barrier, extract(epoch FROM now() - issued_at) AS age_s FROM consistent_barrier"
        ).fetchone()
        upkeep = {
            r["table_name"]: r
            for r in conn.execute(
                "SELECT table_name, enabled, checked_at, next, actions FROM table_maintenance WHERE table_name = ANY(%s)",
                (sorted(shown),),
            )
        }
    tables = {name: _table(r, upkeep.get(name), now) for name, r in shown.items()}
    listed = [r["table_name"] for r in rows]
    if view.select:
        title = f"Topology: the neighbourhood of {view.select}"
    elif graphed:
        title = "Topology of the tables listed"
    else:
        title = f"Topology: {counts[view.state]} tables selected; choose one (or narrow the filters) to draw"
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "view": {"namespace": view.namespace, "state": view.state, "q": view.q, "select": view.select},
        "counts": dict(counts),
        "namespaces": [{"namespace": r["namespace"], "tables": r["tables"]} for r in namespaces],
        "more": counts[view.state] - len(listed) if more else 0,
        "cut": {
            "barrier": barrier_label(cut["barrier"]) if cut and cut["barrier"] else "none yet",
            "age": format_duration_s(cut["age_s"]) if cut and cut["age_s"] is not None else "none yet",
        },
        "topology": topology_figure(
            edges, {n: tables[n] for n in drawn if n in tables} if graphed else {}, title=title, selected=view.select
        ),
        "delays": delay_figure(
            [
                {**d, "issued_at": d["issued_at"].isoformat(), "delay_s": float(d["delay_s"])}
                for d in delays
                if d["delay_s"] is not None
            ]
        ),
        "targets": targets_figure(targeted, completions, now),
        "tables": [{"table": name, **tables[name]} for name in listed],
        "schedule": schedule_state(schedule),
        "leases": [
            {
                "lease": r["lease_id"],
                "holder": r["holder"],
                "table": r["table_name"],
                "snapshot": str(r["snapshot_id"] or "empty"),
                "barrier": barrier_label(r["barrier"]),
                "expires": r["expires_at"].isoformat(timespec="seconds"),
            }
            for r in leases
        ],
    }


def _table(r: dict, upkeep: dict | None, now: datetime) -> dict:
    return {
        "kind": r["table_kind"],
        "writer": r["writer_job"] or "none",
        "watermark": barrier_label(r["watermark_barrier"]),
        "freshness": format_duration_s(r["freshness_s"]) if r["freshness_s"] is not None else "never completed",
        "barriers_behind": int(r["barriers_behind"]),
        "snapshot": str(r["current_snapshot_id"] or "empty"),
        "coalesced": (f"{r['coalesced_after']} .. {r['coalesced_into']}" if r["coalesced_into"] else "none"),
        "target": _target_text(r),
        "target_state": r["target_state"],
        **maintenance_text(upkeep, now),
    }


@router.get("")
def page():
    return HTMLResponse(PAGE.read_text())


@router.get("/plotly.min.js")
def plotly_js():
    return FileResponse(
        str(resources.files("plotly") / "package_data" / "plotly.min.js"),
        media_type="text/javascript",
        headers={"Cache-Control": "max-age=86400"},
    )


@router.get("/state")
def ui_state(who: Caller, lake: LakeDep, request: Request):
    view = View.of(request.query_params)
    with lake.pool.connection() as conn:
        body = json.dumps(state(conn, view), default=str)
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})
