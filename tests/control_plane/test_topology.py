"""Topology rules (enforced by the register_job function) and graph walks, table-driven and
with hypothesis."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icebarrier.control_plane import jobs as cp_jobs
from icebarrier.control_plane.errors import (
    JobDefinitionError,
    SelfReadError,
    SinkAlreadyOwnedError,
    TopologyCycleError,
)
from icebarrier.control_plane.topology import downstream, edges_of, render_dot, render_mermaid, upstream
from tests.helpers import T, job

BASE = {
    "ingest": job("ingest", sinks=["a"]),
    "mid": job("mid", sources=["a"], sinks=["b"]),
    "top": job("top", sources=["b"], sinks=["c"]),
}


@pytest.mark.parametrize(
    "new, error, fragment",
    [
        (job("w2", sinks=["b"]), SinkAlreadyOwnedError, "table lake.db.b is written by job mid"),
        (job("loop", sources=["c"], sinks=["a"]), SinkAlreadyOwnedError, "written by job ingest"),
        (
            job("mid", sources=["a", "c"], sinks=["b"]),
            TopologyCycleError,
            "lake.db.c -> mid -> lake.db.b -> top -> lake.db.c",
        ),
        (job("self", sources=["x"], sinks=["x"]), SelfReadError, "reads its own sink lake.db.x"),
        (job("nosink", sources=["a"]), JobDefinitionError, "has no sink"),
        (job("mixed", sources=["a"], sinks=["z"], external=["kafka:x"]), JobDefinitionError, "both"),
    ],
)
def test_registration_rules(conn, new, error, fragment):
    """Each broken rule raises its own error naming the offending job, table or path, and
    nothing is written."""
    for definition in BASE.values():
        cp_jobs.register(conn, definition)
    with pytest.raises(error) as info:
        cp_jobs.register(conn, new, replace=True)
    assert fragment in str(info.value)
    assert cp_jobs.load_definitions(conn) == BASE


def test_replacing_a_job_frees_its_own_sinks(conn):
    """A job re-registering its own sink is not a second writer."""
    for definition in BASE.values():
        cp_jobs.register(conn, definition)
    assert cp_jobs.register(conn, job("mid", sources=["a"], sinks=["b", "b2"]), replace=True).status == "replaced"


def test_lineage_walks_both_ways():
    """Downstream and upstream list tables nearest first with the job on each hop."""
    jobs = list(BASE.values())
    assert [(str(s.table), s.job, s.depth) for s in downstream(jobs, T("a"))] == [
        ("lake.db.b", "mid", 1),
        ("lake.db.c", "top", 2),
    ]
    assert [(str(s.table), s.depth) for s in upstream(jobs, T("c"))] == [("lake.db.b", 1), ("lake.db.a", 2)]
    assert downstream(jobs, T("c")) == []


def test_renderings_name_every_node():
    """dot and mermaid renderings contain every table, job and external input."""
    edges = edges_of(BASE.values())
    for text in (render_dot(edges), render_mermaid(edges)):
        for node in ("lake.db.a", "lake.db.b", "lake.db.c", "ingest", "mid", "top", "ext:ingest"):
            assert node in text


# -- property: whatever order jobs arrive in, accepted topologies stay acyclic with one writer

tables = st.sampled_from([f"t{i}" for i in range(6)])
job_specs = st.lists(
    st.tuples(st.lists(tables, max_size=3, unique=True), st.lists(tables, min_size=1, max_size=2, unique=True)),
    min_size=1,
    max_size=12,
)


def _is_acyclic(defs) -> bool:
    edges = {}
    for d in defs:
        for s in d.sources:
            edges.setdefault(s, set()).update(d.sinks)
    state = {}

    def visit(n):
        if state.get(n) == 1:
            return False
        if state.get(n) == 2:
            return True
        state[n] = 1
        ok = all(visit(m) for m in edges.get(n, ()))
        state[n] = 2
        return ok

    return all(visit(n) for n in list(edges))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=job_specs)
def test_accepted_topologies_are_acyclic_with_one_writer(conn, specs):
    """Registering random jobs one by one never admits a cycle or a second writer, and every
    refusal has a reason (each example in a transaction rolled back afterwards)."""
    with conn.transaction(force_rollback=True):
        _register_all(conn, specs)


def _register_all(conn, specs):
    accepted = {}
    for i, (sources, sinks) in enumerate(specs):
        candidate = job(f"j{i}", sources=sources, sinks=sinks)
        try:
            cp_jobs.register(conn, candidate)
        except (TopologyCycleError, SinkAlreadyOwnedError, SelfReadError):
            with_it = [*accepted.values(), candidate]
            writers = [t for d in accepted.values() for t in d.sinks]
            refused_for_reason = (
                not _is_acyclic(with_it)
                or any(t in writers for t in candidate.sinks)
                or bool(candidate.sources & candidate.sinks)
            )
            assert refused_for_reason, f"{candidate} refused without reason"
            continue
        accepted[candidate.name] = candidate
        assert _is_acyclic(accepted.values())
        sinks_all = [t for d in accepted.values() for t in d.sinks]
        assert len(sinks_all) == len(set(sinks_all))
