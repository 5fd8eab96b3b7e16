"""No request is a 500: a hostile client's generated requests against a real `icebarrier serve`
(hypothesis). Every route, with names from the whole of unicode (separators, dots, control
characters, very long ones), bodies shaped like the spec's and not, odd headers, and each kind
of token (none, a bad one, a reader, an admin, another job's). Afterwards: no 5xx was answered,
no file was written outside the warehouse, and job A's table is as it was."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icebarrier.control_plane import tokens
from icebarrier.iceberg_ext.catalog import load_table
from tests.iceberg_ext.catalog_server import Pipeline, access_token, start_server, stop_server

ROUTES = [
    ("GET", "/v1/config"),
    ("GET", "/v1/{prefix}/namespaces"),
    ("POST", "/v1/{prefix}/namespaces"),
    ("GET", "/v1/{prefix}/namespaces/{namespace}"),
    ("HEAD", "/v1/{prefix}/namespaces/{namespace}"),
    ("DELETE", "/v1/{prefix}/namespaces/{namespace}"),
    ("POST", "/v1/{prefix}/namespaces/{namespace}/properties"),
    ("GET", "/v1/{prefix}/namespaces/{namespace}/tables"),
    ("POST", "/v1/{prefix}/namespaces/{namespace}/tables"),
    ("POST", "/v1/{prefix}/namespaces/{namespace}/register"),
    ("GET", "/v1/{prefix}/namespaces/{namespace}/tables/{table}"),
    ("HEAD", "/v1/{prefix}/namespaces/{namespace}/tables/{table}"),
    ("DELETE", "/v1/{prefix}/namespaces/{namespace}/tables/{table}"),
    ("POST", "/v1/{prefix}/namespaces/{namespace}/tables/{table}"),
    ("POST", "/v1/{prefix}/namespaces/{namespace}/tables/{table}/metrics"),
    ("GET", "/v1/{prefix}/namespaces/{namespace}/tables/{table}/credentials"),
    ("POST", "/v1/{prefix}/tables/rename"),
    ("POST", "/v1/{prefix}/transactions/commit"),
    ("POST", "/icebarrier/v1/jobs/{job}/session"),
    ("GET", "/icebarrier/v1/jobs/{job}/session"),
    ("PUT", "/icebarrier/v1/jobs/{job}/session/hold"),
    ("POST", "/icebarrier/v1/jobs/{job}/session/publish"),
    ("POST", "/icebarrier/v1/jobs/{job}/session/release"),
    ("POST", "/v1/oauth/tokens"),
    ("GET", "/ui/state"),
    ("GET", "/metrics"),
    ("GET", "/readyz"),
]
EXAMPLES = int(os.environ.get("ICEBARRIER_HOSTILE_EXAMPLES", "300"))

names = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=100, max_size=6000),
    st.sampled_from(
        [".", "..", "a.b", "a/b", "%2F", "..%2F..", "\x00", "\x1f", "a\x1fb", " ", "\n", "ns", "t", "managed"]
    ),
)


def _tables(shared):
    return st.fixed_dictionaries({"namespace": st.lists(shared, min_size=0, max_size=3), "name": shared})


SCHEMA = {"type": "struct", "schema-id": 0, "fields": [{"id": 1, "name": "n", "type": "long", "required": False}]}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def bodies(draw, victim: dict):
    """A body: shaped like one of the spec's requests (with hostile values: another job's table
    as a rename's source, its metadata file to register, locations outside the warehouse), or
    anything at all."""
    name = draw(names)
    outside = draw(st.sampled_from(["/etc", "file:///tmp/elsewhere", "../../x", victim["location"], "s3://other/x"]))
    shaped = [
        {"namespace": draw(st.lists(names, max_size=3)), "properties": {"location": outside}},
        {"name": name, "schema": SCHEMA, "location": outside},
        {"name": name, "metadata-location": victim["metadata"]},
        {"source": victim["identifier"], "destination": draw(_tables(names))},
        {
            "identifier": victim["identifier"],
            "requirements": [],
            "updates": [{"action": "set-location", "location": outside}],
        },
        {"table-changes": [{"identifier": victim["identifier"], "requirements": [], "updates": []}]},
        {"removals": draw(st.lists(names, max_size=3)), "updates": {"location": outside}},
    ]
    return draw(st.one_of(st.sampled_from(shaped), json_values))


def _mostly(real, generated):
    """Real names three times in four, so that requests get past the first lookup."""
    return st.one_of(real, real, real, generated)


def _listing(*roots: Path) -> set[str]:
    return {str(p) for root in roots for p in root.rglob("*") if p.is_file()}


def test_no_request_is_a_server_error(lake, tmp_path):
    """Generated requests on every route with every kind of token: never a 5xx, never a file
    outside the warehouse, never a change to another job's table."""
    Pipeline(lake, {"owner": ["managed"]})  # job A's table, the victim
    Pipeline(lake, {"other": ["mine"]})  # job B: a token that may write, but not A's table
    victim_table = load_table(lake.catalog, lake.T("managed"))
    victim = {
        "identifier": {"namespace": [lake.namespace], "name": "managed"},
        "metadata": victim_table.metadata_location,
        "location": victim_table.metadata.location,
    }
    warehouse = Path(lake.settings.warehouse.removeprefix("file://"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    around = [warehouse.parent, cwd]
    before = _listing(*around)
    proc, server = start_server(lake, cwd=cwd)
    try:
        credentials = {
            "none": None,
            "bad": "Bearer not-a-token",
            "reader": tokens.create(lake.conn, whole_lake=True),
            "admin": tokens.create(lake.conn, admin=True),
            "other job": tokens.create(lake.conn, job=f"{lake.namespace}_other", whole_lake=True),
        }
        headers_of = {
            kind: (
                {"Authorization": value}
                if isinstance(value, str)
                else {"Authorization": f"Bearer {access_token(server, *value)}"}
                if value
                else {}
            )
            for kind, value in credentials.items()
        }
        served: list[tuple[str, str, int]] = []
        http = requests.Session()

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(
            route=st.sampled_from(ROUTES),
            kind=st.sampled_from(sorted(headers_of)),
            prefix=_mostly(
                st.sampled_from(["latest", "read-committed", "barrier-1", "job", "job:nope", "lease-x"]), names
            ),
            levels=_mostly(st.just([lake.namespace]), st.lists(names, min_size=1, max_size=3)),
            table=_mostly(st.sampled_from(["managed", "mine"]), names),
            job=st.one_of(st.just(f"{lake.namespace}_owner"), names),
            body=bodies(victim),
            extra=st.dictionaries(
                st.sampled_from(["X-Request-Id", "Idempotency-Key", "Content-Type", "X-Iceberg-Access-Delegation"]),
                st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80).map(str.strip),
                max_size=2,
            ),
        )
        def one(route, kind, prefix, levels, table, job, body, extra):
            method, template = route
            path = (
                template.replace("{prefix}", quote(prefix, safe=""))
                .replace("{namespace}", "%1F".join(quote(level, safe="") for level in levels))
                .replace("{table}", quote(table, safe=""))
                .replace("{job}", quote(job, safe=""))
            )
            headers = {**headers_of[kind], **extra}
            sent = {"json": body} if method in ("POST", "PUT") and "Content-Type" not in extra else {}
            if method in ("POST", "PUT") and "Content-Type" in extra:
                sent = {"data": repr(body).encode()}
            r = http.request(method, f"{server}{path}", headers=headers, timeout=60, **sent)
            served.append((method, template, r.status_code))
            assert r.status_code < 500, f"{method} {path} ({kind}) -> {r.status_code}: {r.text[:500]}"

        one()
    finally:
        stop_server(proc)
    assert len(served) >= EXAMPLES
    statuses = Counter(status for _, _, status in served)
    assert sum(n for s, n in statuses.items() if s < 300) > 0 and len(statuses) >= 5, statuses  # they went deep
    after = _listing(*around)
    outside = sorted(p for p in after - before if not p.startswith(str(warehouse)))
    assert not outside, f"files written outside the warehouse: {outside[:10]}"
    assert load_table(lake.catalog, lake.T("managed")).metadata_location == victim["metadata"]
