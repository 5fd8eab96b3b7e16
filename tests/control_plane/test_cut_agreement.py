"""SQL cut resolution and protected sets agree with the pure definitions on random histories.

The pure definitions (:mod:`icebarrier.control_plane.cuts`: a table has completed B iff
start <= B <= watermark and B is not coalesced in it; the latest valid cut is the newest
barrier every table has completed; S(T, B) is T's latest commit with barrier <= B) are
replayed in Python over a random history — tables completing barriers one by one, skipping
runs without commits, or coalescing runs — that is also written through the control plane;
the SQL answers of ``reads.resolve`` (latest cut, and the cut at every issued barrier) must be
the same.
"""

import uuid

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from icebarrier.control_plane import barriers, db, jobs, leases, reads
from icebarrier.control_plane.cuts import check_valid_at, latest_valid_barrier, protected_set, removable
from icebarrier.control_plane.errors import BarrierNotValidError, NoValidCutError
from icebarrier.control_plane.model import JobDefinition, TableName, TableState


@st.composite
def histories(draw):
    """K barriers; per table: started at barrier s (or never), progressing to barrier l through
    completion points (each jump over barriers a skip if it commits nothing, or coalesced),
    with a commit at some of them."""
    k = draw(st.integers(1, 8))
    tables = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) or not tables:
            start = draw(st.integers(0, k - 1))
            last = start + draw(st.integers(1, k - start)) - 1
            points = sorted({start, last, *(i for i in range(start + 1, last) if draw(st.booleans()))})
            commits = [p for p in points if draw(st.booleans())]
            coalesced = {
                p for prev, p in zip(points, points[1:]) if p - prev > 1 and (p in commits or draw(st.booleans()))
            }
            tables.append((start, last, commits, points, coalesced))
        else:
            tables.append((None, None, [], [], set()))
    return k, tables


def _snapshot_at(commits: dict[int, int], barrier: int) -> int | None:
    """S(T, B): the latest commit with barrier <= B (None: T had no snapshot then)."""
    older = [b for b in commits if b <= barrier]
    return commits[max(older)] if older else None


def _replay(conn, k: int, spec, *, downstream=None):
    """Write the history through the control plane: barrier after barrier, the jobs due
    complete it (a downstream job reading table 0 right after it). Returns (names, marks,
    commits per table, downstream job name or None)."""
    tag = uuid.uuid4().hex[:8]
    names = [TableName.parse(f"lake.h_{tag}.t{i}") for i in range(len(spec))]
    for i, name in enumerate(names):
        jobs.register(
            conn,
            JobDefinition(name=f"j{tag}_{i}", sinks=frozenset([name]), external_inputs=frozenset([f"ext:{tag}{i}"])),
        )
    derived = None
    if downstream is not None:
        derived = f"d{tag}"
        names.append(TableName.parse(f"lake.h_{tag}.derived"))
        jobs.register(conn, JobDefinition(name=derived, sources=frozenset([names[0]]), sinks=frozenset([names[-1]])))
    marks, commits = [], {name: {} for name in names}

    def complete(job: str, table: TableName, b: int, commit: bool, coalesce: bool = False) -> None:
        snapshot = {table: int(uuid.uuid4().int % 2**62) + 1} if commit else {}
        commits[table].update({b: snapshot[table]} if commit else {})
        jobs.complete(conn, job, b, snapshot, coalesce=coalesce)

    for step in range(k):
        b = barriers.issue(conn).barrier
        marks.append(b)
        for i, (_, _, committed, points, coalesced) in enumerate(spec):
            if step in points:
                complete(f"j{tag}_{i}", names[i], b, step in committed, step in coalesced)
    for step in downstream[2] if downstream is not None else ():  # once table 0 has passed them
        complete(derived, names[-1], marks[step], step % 2 == 0, coalesce=True)
    return names, marks, commits, derived


def _states(names, marks, spec, downstream):
    rows = [(s, last, points, coalesced) for s, last, _, points, coalesced in spec]
    if downstream is not None:
        rows.append((downstream[2][0], downstream[2][-1], downstream[2], set(downstream[2][1:])))
    return [
        TableState(
            name=name,
            start_barrier=None if s is None else marks[s],
            watermark=None if last is None else marks[last],
            coalesced=tuple(
                (marks[prev], marks[p]) for prev, p in zip(points, points[1:]) if p in coalesced and p - prev > 1
            ),
        )
        for name, (s, last, points, coalesced) in zip(names, rows)
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories())
def test_sql_cuts_agree_with_the_pure_definitions(conn, history):
    """Latest cut and the cut at every issued barrier: same validity, barrier, snapshots and
    nearest valid cuts."""
    k, spec = history
    names, marks, commits, _ = _replay(conn, k, spec)
    states = _states(names, marks, spec, None)
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
        except BarrierNotValidError as expected_error:
            with pytest.raises(BarrierNotValidError) as info:
                reads.resolve(conn, names, barrier=b)
            assert (info.value.reasons, info.value.nearest) == (expected_error.reasons, expected_error.nearest)
            continue
        cut = reads.resolve(conn, names, barrier=b)
        assert cut.barrier == b
        assert cut.snapshots == {n: _snapshot_at(commits[n], b) for n in names}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories(), data=st.data())
def test_sql_protected_sets_agree_with_the_pure_definition(make_db, template_db, history, data):
    """Each table's protected set — current snapshot, live leases, downstream progress and the
    read-committed window (S(T, lo) and commits in (lo, W(T)], lo the newest barrier up to the
    lowest watermark that no table coalesced) — is
    the pure definition's, reasons included; expiry's claim removes exactly the candidates
    outside it."""
    k, spec = history
    downstream = None
    if spec[0][0] is not None:  # a job reading table 0, at some of the barriers table 0 completed
        completed = [
            i
            for i in range(spec[0][0], spec[0][1] + 1)
            if not any(p in spec[0][4] and prev < i < p for prev, p in zip(spec[0][3], spec[0][3][1:]))
        ]
        steps = sorted(set(data.draw(st.lists(st.sampled_from(completed), min_size=1, max_size=4))))
        downstream = (steps[0], steps[-1], steps)
    with db.connect(make_db(template_db)) as conn:  # lo spans every table: one database per history
        names, marks, commits, derived = _replay(conn, k, spec, downstream=downstream)
        states = _states(names, marks, spec, downstream)
        held = []
        for b in marks:
            try:
                check_valid_at(states, b)
            except BarrierNotValidError:
                continue
            if data.draw(st.booleans()):
                cut = leases.acquire(conn, names, ttl_s=600, holder="agreement", barrier=b)
                held.append((cut.lease_id, cut.snapshots))
        started = [s for s in states if s.watermark is not None]
        lo = latest_valid_barrier(started, check_starts=False) if started else None
        for state in states:
            name, own = state.name, commits[state.name]
            window = (
                [None]
                if lo is None
                else [_snapshot_at(own, lo)] + [sid for b, sid in sorted(own.items()) if lo < b <= state.watermark]
            )
            progress = (
                [(derived, _snapshot_at(own, marks[downstream[2][-1]]))]
                if derived is not None and name == names[0]
                else []
            )
            expected = protected_set(
                current=own[max(own)] if own else None,
                leases=[(lid, snaps[name]) for lid, snaps in held],
                job_progress=progress,
                read_window=window,
            )
            got = leases.protected(conn, name)
            assert {s: sorted(p.reasons) for s, p in got.items()} == {
                s: sorted(p.reasons) for s, p in expected.items()
            }, name
            # Expiry's claim (decided in SQL under the table lock) removes exactly the rest.
            candidates = sorted({*own.values(), 4242})
            claim = leases.claim_expiry(conn, name, candidates, dry_run=True)
            assert list(claim.removable) == removable(candidates, expected), name


def test_expiry_claims_exactly_what_no_reason_keeps(conn):
    """A history where every reason protects something (a lease on an old cut, downstream
    progress and the read-committed window, the current snapshot, retention, a tag): the claim
    removes exactly the unprotected old snapshot and an unknown id, and agrees with the pure
    definition."""
    src, derived = TableName.parse("lake.k.src"), TableName.parse("lake.k.derived")
    jobs.register(conn, JobDefinition(name="k_src", sinks=frozenset([src]), external_inputs=frozenset(["ext:k"])))
    jobs.register(conn, JobDefinition(name="k_derived", sources=frozenset([src]), sinks=frozenset([derived])))
    marks = []
    for step, snapshot in enumerate([100, 101, 102, 103, 104]):
        marks.append(barriers.issue(conn).barrier)
        jobs.complete(conn, "k_src", marks[-1], {src: snapshot})
        if step <= 2:
            jobs.complete(conn, "k_derived", marks[-1], {derived: 200 + step})
    lease = leases.acquire(conn, [src], ttl_s=600, holder="old reader", barrier=marks[1])
    candidates = [100, 101, 102, 103, 104, 98, 99, 4242]
    claim = leases.claim_expiry(conn, src, candidates, retained=(99,), tagged=(("audit", 98),), dry_run=True)
    assert claim.removable == (100, 4242)
    assert claim.protected[101].reasons == (f"lease:{lease.lease_id}",)
    assert list(claim.removable) == removable(candidates, claim.protected)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories(), namespace_of_one=st.booleans())
# found by Hypothesis: a range coalesced in t1 moves the candidate below t0's start (0034)
@example(history=(3, [(1, 1, [], [1], set()), (0, 2, [2], [0, 2], {2})]), namespace_of_one=False)
def test_the_whole_lake_and_namespace_cuts_agree_with_the_pure_definition(
    make_db, template_db, history, namespace_of_one
):
    """latest_cut(NULL) (the read-committed warehouse, the watermark and start indexes, the coalesced
    ranges around the candidate) and latest_cut(namespace) are the newest barrier every tracked
    table of the lake / the namespace has completed, as defined; a namespace's name is not a
    pattern (an `_` in it matches itself only)."""
    k, spec = history
    with db.connect(make_db(template_db)) as conn:  # the whole lake: one database per history
        names, marks, _, _ = _replay(conn, k, spec)
        if namespace_of_one:  # a look-alike namespace (`_` matching any character) must not count
            odd = TableName.parse(f"lake.{names[0].namespace[0].replace('_', 'x')}.t")
            jobs.register(
                conn,
                JobDefinition(name="lookalike", sinks=frozenset([odd]), external_inputs=frozenset(["ext:lookalike"])),
            )
        states = _states(names, marks, spec, None)
        try:
            expected = latest_valid_barrier(states)
        except NoValidCutError:
            expected = None
        namespace = f"{names[0].catalog}.{names[0].namespace[0]}"
        assert conn.execute("SELECT latest_cut(%s) AS b", (namespace,)).fetchone()["b"] == expected
        whole = conn.execute("SELECT latest_cut(NULL) AS b").fetchone()["b"]
        assert whole == (None if namespace_of_one else expected)  # the unstarted look-alike is in the lake
