"""Graph walks and renderings of the topology. Pure: values in, values out, no I/O.

The topology is a bipartite DAG of tables and jobs: a job reads its sources and writes
its sinks. The registration rules (a table has at most one active writer, the graph is
acyclic, a job never reads its own sink) are enforced where every client meets them: the
``register_job`` function (migration 0007).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from icebarrier.control_plane.model import JobDefinition, TableName


def writer_by_table(jobs: Iterable[JobDefinition]) -> dict[TableName, str]:
    return {table: job.name for job in jobs for table in job.sinks}


def jobs_read_from(jobs: Iterable[JobDefinition]) -> dict[str, list[str]]:
    """Each job's upstream jobs: the writers of its sources, by name."""
    jobs = list(jobs)
    writer = writer_by_table(jobs)
    return {job.name: sorted({writer[s] for s in job.sources if s in writer}) for job in jobs}


@dataclass(frozen=True, slots=True, kw_only=True)
class LineageStep:
    """``table`` is reached from the start table through ``job`` at ``depth`` hops."""

    table: TableName
    job: str
    depth: int


def downstream(jobs: Iterable[JobDefinition], table: TableName) -> list[LineageStep]:
    """Every table computed (transitively) from ``table``, nearest first."""
    readers: dict[TableName, list[JobDefinition]] = {}
    for job in jobs:
        for source in job.sources:
            readers.setdefault(source, []).append(job)
    return _walk(table, lambda t: [(j.name, s) for j in readers.get(t, ()) for s in j.sinks])


def upstream(jobs: Iterable[JobDefinition], table: TableName) -> list[LineageStep]:
    """Every managed table ``table`` is computed from (transitively), nearest first."""
    writer = {sink: job for job in jobs for sink in job.sinks}
    return _walk(table, lambda t: [(writer[t].name, s) for s in writer[t].sources] if t in writer else [])


def _walk(start: TableName, neighbours) -> list[LineageStep]:
    steps: list[LineageStep] = []
    seen = {start}
    frontier = [start]
    depth = 0
    while frontier:
        depth += 1
        nxt: list[TableName] = []
        for table in frontier:
            for job_name, other in sorted(neighbours(table), key=lambda p: (p[0], p[1])):
                if other not in seen:
                    seen.add(other)
                    nxt.append(other)
                    steps.append(LineageStep(table=other, job=job_name, depth=depth))
        frontier = nxt
    return steps


# -- rendering ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    from_node: str
    to_node: str
    edge_kind: str  # "reads" (input -> job) or "writes" (job -> table)
    from_kind: str  # "table", "external" or "job"
    to_kind: str


def edges_of(jobs: Iterable[JobDefinition]) -> list[Edge]:
    edges = []
    for job in sorted(jobs, key=lambda j: j.name):
        for ext in sorted(job.external_inputs):
            edges.append(Edge(from_node=ext, to_node=job.name, edge_kind="reads", from_kind="external", to_kind="job"))
        for src in sorted(job.sources):
            edges.append(
                Edge(from_node=str(src), to_node=job.name, edge_kind="reads", from_kind="table", to_kind="job")
            )
        for sink in sorted(job.sinks):
            edges.append(
                Edge(from_node=job.name, to_node=str(sink), edge_kind="writes", from_kind="job", to_kind="table")
            )
    return edges


def render_dot(edges: list[Edge]) -> str:
    shapes = {"table": "box", "external": "note", "job": "ellipse"}
    nodes = {}
    for e in edges:
        nodes[e.from_node] = e.from_kind
        nodes[e.to_node] = e.to_kind
    lines = ["digraph icebarrier {", "  rankdir=LR;"]
    for node, kind in nodes.items():
        lines.append(f'  "{_dot_escape(node)}" [shape={shapes[kind]}];')
    for e in edges:
        lines.append(f'  "{_dot_escape(e.from_node)}" -> "{_dot_escape(e.to_node)}";')
    lines.append("}")
    return "\n".join(lines)


def render_mermaid(edges: list[Edge]) -> str:
    ids: dict[str, str] = {}

    def node(name: str, kind: str) -> str:
        if name not in ids:
            ids[name] = f"{kind[0]}{len(ids)}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"
            label = name.replace('"', "'")
            shape = {"table": f'["{label}"]', "external": f'>"{label}"]', "job": f'(["{label}"])'}[kind]
            return ids[name] + shape
        return ids[name]

    lines = ["flowchart LR"]
    for e in edges:
        lines.append(f"  {node(e.from_node, e.from_kind)} --> {node(e.to_node, e.to_kind)}")
    return "\n".join(lines)


def render_text(jobs: Iterable[JobDefinition]) -> str:
    lines = []
    for job in sorted(jobs, key=lambda j: j.name):
        inputs = sorted(job.external_inputs) or [str(t) for t in sorted(job.sources)]
        kind = "root" if job.is_root else "intermediate"
        lines.append(f"{', '.join(inputs)} --[{job.name} ({kind})]--> {', '.join(str(t) for t in sorted(job.sinks))}")
    return "\n".join(lines)


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
