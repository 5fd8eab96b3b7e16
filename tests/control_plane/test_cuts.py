"""Cut resolution and protected sets, table-driven and with hypothesis."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icebarrier.control_plane.cuts import check_valid_at, latest_valid_barrier, protected_set, removable
from icebarrier.control_plane.errors import BarrierNotValidError, NoValidCutError
from icebarrier.control_plane.model import TableState
from tests.helpers import T


def S(name, start, watermark):
    return TableState(name=T(name), start_barrier=start, watermark=watermark)


@pytest.mark.parametrize(
    "states, expected",
    [
        ([S("a", 1, 5)], 5),
        ([S("a", 1, 5), S("b", 1, 3)], 3),
        ([S("a", 2, 9), S("b", 4, 4), S("c", 1, 7)], 4),
    ],
)
def test_latest_valid_barrier_is_lowest_watermark(states, expected):
    """The latest valid cut is at the lowest watermark when every table started by then."""
    assert latest_valid_barrier(states) == expected


@pytest.mark.parametrize(
    "states, fragment",
    [
        ([S("a", 1, 5), S("b", None, None)], "lake.db.b completed no barrier yet"),
        ([S("a", 1, 3), S("b", 4, 8)], "lake.db.b started after barrier 3"),
        ([], "no tables given"),
    ],
)
def test_no_valid_cut(states, fragment):
    """Without a barrier that every table completed, the error names the table to wait for."""
    with pytest.raises(NoValidCutError, match=fragment):
        latest_valid_barrier(states)


def test_check_valid_at_names_each_failing_table():
    """An explicit barrier outside a table's [start, watermark] names that table and why."""
    states = [S("a", 1, 5), S("b", 3, 9), S("c", None, None)]
    check_valid_at(states[:2], 4)
    with pytest.raises(BarrierNotValidError) as info:
        check_valid_at(states, 2)
    assert info.value.reasons == {"lake.db.b": "started at barrier 3", "lake.db.c": "has completed no barrier yet"}
    with pytest.raises(BarrierNotValidError, match="lake.db.a has only completed up to 5"):
        check_valid_at(states[:2], 7)


progress = st.tuples(st.integers(1, 20), st.integers(0, 20)).map(lambda p: (p[0], p[0] + p[1]))


@settings(max_examples=300, deadline=None)
@given(st.lists(progress, min_size=1, max_size=6))
def test_latest_valid_barrier_matches_brute_force(ranges):
    """The resolved barrier is the largest B completed by every table, or there is none."""
    states = [S(f"t{i}", a, b) for i, (a, b) in enumerate(ranges)]
    valid = [b for b in range(0, 45) if all(s.has_completed(b) for s in states)]
    if valid:
        assert latest_valid_barrier(states) == max(valid)
        check_valid_at(states, max(valid))
    else:
        with pytest.raises(NoValidCutError):
            latest_valid_barrier(states)


def test_protected_set_collects_reasons():
    """Each snapshot lists every reason it is kept; None (empty table) is ignored."""
    got = protected_set(
        current=10,
        leases=[("L1", 7), ("L2", None)],
        job_progress=[("agg", 7)],
        read_window=[9, 10],
        retained=[8],
        tagged=[("nightly", 3)],
    )
    assert {s: p.reasons for s, p in got.items()} == {
        3: ("ref:nightly",),
        7: ("lease:L1", "job:agg"),
        8: ("retention",),
        9: ("read-committed",),
        10: ("current", "read-committed"),
    }


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(1, 50)), st.sets(st.integers(1, 50)))
def test_removable_never_contains_protected(candidates, keep):
    """Expiry removes exactly the candidates outside the protected set."""
    out = removable(candidates, keep)
    assert set(out) == candidates - keep
