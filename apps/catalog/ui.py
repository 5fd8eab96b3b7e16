"""The status page, ``GET /ui``: a live picture of the pipeline (read-only).

``/ui`` is one HTML page; it polls ``/ui/state`` (every 2 s) and draws with plotly.js, served
from the installed ``plotly`` package at ``/ui/plotly.min.js`` (no CDN). The state holds
plotly figures built here: the topology as a layered graph (externals, jobs and tables; tables
coloured by barriers behind), each job's delay over its recent barriers, and each table's
freshness against its target lag over the last minutes; and tables of the tables (watermark,
freshness, target lag, coalesced range, maintenance's last action and what comes next), the
schedule's next planned runs, active leases and the read-committed cut.

The state needs a reader (or job) token, like any catalog read, unless the server allows
anonymous reads; the page asks for CLIENT_ID:SECRET when it gets a 401 and keeps the access
token in the browser tab's session storage.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, Response

from icebarrier.apps.catalog.deps import Caller, LakeDep
from icebarrier.control_plane.model import barrier_label, format_duration_s

router = APIRouter(prefix="/ui")
PAGE = Path(__file__).with_name("ui.html")
RECENT_BARRIERS = 60
TARGET_WINDOW_S = 600  # the freshness chart's span


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


def topology_figure(edges: list[dict], tables: dict[str, dict]) -> dict:
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
    for kind, symbol in (("external", "diamond"), ("job", "square"), ("table", "circle")):
        names = [n for n in sorted(kinds) if kinds[n] == kind]
        behind = [tables.get(n, {}).get("barriers_behind", 0) for n in names]
        text = [
            n
            if kind != "table"
            else f"{n}<br>behind {tables[n]['barriers_behind']} barrier(s), fresh {tables[n]['freshness']}"
            for n in names
        ]
        marker = {"symbol": symbol, "size": 18}
        if kind == "table":
            marker |= {
                "color": behind,
                "colorscale": [[0, "#2ca02c"], [0.5, "#ffbf00"], [1, "#d62728"]],
                "cmin": 0,
                "cmax": max(4, *behind) if behind else 4,
                "showscale": True,
                "colorbar": {"title": {"text": "barriers behind"}},
            }
        else:
            marker |= {"color": "#1f77b4" if kind == "job" else "#7f7f7f"}
        fig.add_trace(
            go.Scatter(
                x=[at[n][0] for n in names],
                y=[-at[n][1] for n in names],
                mode="markers+text",
                text=[n.split(".")[-1] for n in names],
                textposition="top center",
                hovertext=text,
                hoverinfo="text",
                marker=marker,
                name=kind,
            )
        )
    fig.update_layout(
        title={"text": "Topology (tables coloured by barriers behind)"},
        xaxis={"visible": False},
        yaxis={"visible": False},
        margin={"l": 10, "r": 10, "t": 40, "b": 10},
        height=360,
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


def state(conn) -> dict:
    """What the page shows, read in one transaction."""
    with conn.transaction():
        edges = conn.execute(
            "SELECT from_node, to_node, edge_kind, from_kind, to_kind FROM topology_edges ORDER BY 1, 2"
        ).fetchall()
        rows = conn.execute(
            "SELECT table_name, table_kind, writer_job, watermark_barrier, current_snapshot_id, "
            "extract(epoch FROM freshness) AS freshness_s, barriers_behind, coalesced_after, "
            "coalesced_into, extract(epoch FROM effective_target_lag) AS effective_s, target_from, target_met "
            "FROM table_versions ORDER BY table_name"
        ).fetchall()
        now = conn.execute("SELECT now() AS now").fetchone()["now"]
        targeted = {r["table_name"]: float(r["effective_s"]) for r in rows if r["effective_s"] is not None}
        completions = conn.execute(
            "SELECT table_name, issued_at, completed_at FROM barrier_delay WHERE table_name = ANY(%s) "
            "AND completed_at > now() - make_interval(secs => %s) ORDER BY table_name, completed_at",
            (list(targeted), TARGET_WINDOW_S),
        ).fetchall()
        schedule = conn.execute("SELECT holder, seen_at, plan FROM schedule_plan").fetchone()
        delays = conn.execute(
            "SELECT job_name, barrier, issued_at, extract(epoch FROM delay) AS delay_s FROM job_delay "
            "WHERE barrier >= coalesce((SELECT min(barrier) FROM (SELECT barrier FROM barrier ORDER BY barrier DESC "
            "LIMIT %s) r), 0) ORDER BY issued_at",
            (RECENT_BARRIERS,),
        ).fetchall()
        leases = conn.execute(
            "SELECT lease_id::text, holder, table_name, snapshot_id, barrier, expires_at "
            "FROM active_leases ORDER BY expires_at, table_name"
        ).fetchall()
        cut = conn.execute(
            "SELECT barrier, extract(epoch FROM now() - issued_at) AS age_s FROM consistent_barrier"
        ).fetchone()
        upkeep = {
            r["table_name"]: r
            for r in conn.execute("SELECT table_name, enabled, checked_at, next, actions FROM table_maintenance")
        }
    tables = {
        r["table_name"]: {
            "kind": r["table_kind"],
            "writer": r["writer_job"] or "none",
            "watermark": barrier_label(r["watermark_barrier"]),
            "freshness": format_duration_s(r["freshness_s"]) if r["freshness_s"] is not None else "never completed",
            "barriers_behind": int(r["barriers_behind"]),
            "snapshot": str(r["current_snapshot_id"] or "empty"),
            "coalesced": (f"{r['coalesced_after']} .. {r['coalesced_into']}" if r["coalesced_into"] else "none"),
            "target": _target_text(r),
            **maintenance_text(upkeep.get(r["table_name"]), now),
        }
        for r in rows
    }
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "cut": {
            "barrier": barrier_label(cut["barrier"]) if cut and cut["barrier"] else "none yet",
            "age": format_duration_s(cut["age_s"]) if cut and cut["age_s"] is not None else "none yet",
        },
        "topology": topology_figure(edges, tables),
        "delays": delay_figure(
            [
                {**d, "issued_at": d["issued_at"].isoformat(), "delay_s": float(d["delay_s"])}
                for d in delays
                if d["delay_s"] is not None
            ]
        ),
        "targets": targets_figure(targeted, completions, now),
        "tables": [{"table": name, **t} for name, t in tables.items()],
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
def ui_state(who: Caller, lake: LakeDep):
    with lake.pool.connection() as conn:
        body = json.dumps(state(conn), default=str)
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})
