"""SQL cut resolution agrees with the pure definitions on random histories.

The pure definitions (:mod:`icebarrier.control_plane.cuts`: a table has completed B iff
start <= B <= watermark; the latest valid cut is at the lowest watermark once every table
has started by then; S(T, B) is T's latest commit with barrier <= B) are replayed in Python
over a random history that is also written through the control plane; the SQL answers of
``reads.resolve`` (latest cut, and the cut at every issued barrier) must be the same.
"""

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icebarrier.control_plane import barriers, jobs, reads
from icebarrier.control_plane.cuts import check_valid_at, latest_valid_barrier
from icebarrier.control_plane.errors import BarrierNotValidError, NoValidCutError
from icebarrier.control_plane.model import JobDefinition, TableName, TableState


@st.composite
def histories(draw):
    """K barriers; per table: started at barrier s (or never), completed c barriers from there,
    with a commit at some of them."""
    k = draw(st.integers(1, 7))
    tables = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) or not tables:
            start = draw(st.integers(0, k - 1))
            done = draw(st.integers(1, k - start))
            commits = [i for i in range(start, start + done) if draw(st.booleans())]
            tables.append((start, start + done - 1, commits))
        else:
            tables.append((None, None, []))
    return k, tables


def _snapshot_at(commits: dict[int, int], barrier: int) -> int | None:
    """S(T, B): the latest commit with barrier <= B (None: T had no snapshot then)."""
    older = [b for b in commits if b <= barrier]
    return commits[max(older)] if older else None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories())
def test_sql_cuts_agree_with_the_pure_definitions(conn, history):
    """Latest cut and the cut at every issued barrier: same validity, barrier and snapshots."""
    k, spec = history
    tag = uuid.uuid4().hex[:8]
    names = [TableName.parse(f"lake.h{tag}.t{i}") for i in range(len(spec))]
    for i, name in enumerate(names):
        jobs.register(conn, JobDefinition(name=f"j{tag}_{i}", sinks=frozenset([name]),
                                          external_inputs=frozenset([f"ext:{tag}{i}"])))
    marks, commits = [], {name: {} for name in names}
    for step in range(k):  # chronologically: issue the barrier, then the jobs due complete it
        b = barriers.issue(conn).barrier
        marks.append(b)
        for i, (start, last, committed) in enumerate(spec):
            if start is not None and start <= step <= last:
                snapshot = {}
                if step in committed:
                    snapshot = {names[i]: int(uuid.uuid4().int % 2**62) + 1}
                    commits[names[i]][b] = snapshot[names[i]]
                jobs.complete(conn, f"j{tag}_{i}", b, snapshot)
    states = [TableState(name=name, start_barrier=None if s is None else marks[s],
                         watermark=None if last is None else marks[last])
              for name, (s, last, _) in zip(names, spec)]

    try:
        expected = latest_valid_barrier(states)
    except NoValidCutError:
        with pytest.raises(NoValidCutError):
            reads.resolve(conn, names)
    else:
        cut = reads.resolve(conn, names)
        assert cut.barrier == expected
        assert cut.snapshots == {n: _snapshot_at(commits[n], expected) for n in names}

    for b in marks:
        try:
            check_valid_at(states, b)
        except BarrierNotValidError:
            with pytest.raises(BarrierNotValidError):
                reads.resolve(conn, names, barrier=b)
            continue
        cut = reads.resolve(conn, names, barrier=b)
        assert cut.barrier == b
        assert cut.snapshots == {n: _snapshot_at(commits[n], b) for n in names}
