"""Cached loads (apps/catalog/etags.py) through a real `icebarrier serve` and plain HTTP, as an
Iceberg 1.11+ client sends them: an ``ETag`` on every table and view load, ``If-None-Match``
with the current tag answered ``304`` without a body, anything else a full ``200``. And the rest
of 1.11's protocol: ``idempotency-key-lifetime`` in ``/v1/config``, ``referenced-by`` accepted.
(Spark's own client, Iceberg 1.12, answered 304: test_catalog_server.py's Spark test.)"""

from __future__ import annotations

import time

import pytest
import requests

from icebarrier.control_plane import leases, reads, tokens
from tests.iceberg_ext.catalog_server import Pipeline, access_token, rest, scrape
from tests.iceberg_ext.test_views import ROW, _version

pytestmark = pytest.mark.slow


def _load(server: str, warehouse: str, name: str, headers: dict, tag: str | None = None) -> requests.Response:
    namespace, table = name.rsplit(".", 1)
    sent = {**headers, **({"If-None-Match": tag} if tag is not None else {})}
    r = requests.get(f"{server}/v1/{warehouse}/namespaces/{namespace}/tables/{table}", headers=sent, timeout=30)
    assert r.status_code in (200, 304), r.text
    return r


def _fresh(server, warehouse, name, headers) -> tuple[str, str]:
    """A full load's (ETag, metadata-location), and the same tag sent back answered 304, body-less."""
    first = _load(server, warehouse, name, headers)
    tag = first.headers["ETag"]
    assert first.status_code == 200 and tag.startswith('"') and tag.endswith('"')
    again = _load(server, warehouse, name, headers, tag)
    assert (again.status_code, again.content, again.headers["ETag"]) == (304, b"", tag), warehouse
    return tag, first.json()["metadata-location"]


def test_every_warehouse_tags_its_loads_and_answers_the_current_tag_304(lake, server):
    """latest, barrier-<B> of two barriers, read-committed, read-committed:<ns> and a lease: each
    answer tagged, its tag answered 304; three metadata files make three tags; a commit changes
    latest's tag and leaves a barrier's; stale, foreign and malformed tags get a full 200; the
    304s are counted in /metrics."""
    p = Pipeline(lake, {"ingest": ["orders", "payments"]})
    first, second = p.advance(rows=3), p.advance(rows=3)
    headers = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}
    name = f"{lake.namespace}.orders"
    lease = leases.acquire(lake.conn, [lake.T("orders")], ttl_s=600, holder="t", barrier=first)
    warehouses = [
        "latest",
        f"barrier-{first}",
        f"barrier-{second}",
        "read-committed",
        f"read-committed:{lake.namespace}",
        f"lease-{lease.lease_id}",
    ]
    tags = {w: _fresh(server, w, name, headers) for w in warehouses}
    by_location: dict[str, set[str]] = {}
    for tag, location in tags.values():
        by_location.setdefault(location, set()).add(tag)
    # three metadata files (the lease at the first barrier; barrier-<second> and both
    # read-committed at the second, pinned; latest the table's own): three tags, one each (the
    # same bytes through two warehouses are the same answer, and a client keeps one per catalog)
    assert len(by_location) == 3 and all(len(t) == 1 for t in by_location.values())
    assert len({t for t, _ in tags.values()}) == 3

    other = _fresh(server, "latest", f"{lake.namespace}.payments", headers)[0]
    latest = tags["latest"][0]
    for stale in (other, tags[f"barrier-{first}"][0], latest[:-3] + 'x"', "not a tag", '""', latest.strip('"')):
        r = _load(server, "latest", name, headers, stale)
        assert r.status_code == 200 and r.headers["ETag"] == latest and r.json()["metadata"], stale
    for listed in (f"{other}, {latest}", f"W/{latest}", "*"):
        assert _load(server, "latest", name, headers, listed).status_code == 304, listed

    third = p.advance(rows=3)
    moved = _load(server, "latest", name, headers, latest)
    assert moved.status_code == 200 and moved.headers["ETag"] != latest
    assert _load(server, f"barrier-{first}", name, headers, tags[f"barrier-{first}"][0]).status_code == 304
    assert _load(server, f"barrier-{third}", name, headers, tags[f"barrier-{second}"][0]).status_code == 200

    # a read-committed session moves with its moment: once it has, the old tag is a full answer
    session = tags["read-committed"][0]
    deadline = time.monotonic() + 60
    while (r := _load(server, "read-committed", name, headers, session)).status_code == 304:
        assert time.monotonic() < deadline, "the read-committed session never moved past its first cut"
        time.sleep(0.2)
    cut = reads.resolve(lake.conn, [lake.T("orders")], barrier=third).snapshots[lake.T("orders")]
    assert r.headers["ETag"] != session and r.json()["metadata"]["current-snapshot-id"] == cut

    counted = scrape(server, headers)
    assert counted[("icebarrier_catalog_loads_not_modified_total", (("warehouse", "latest"),))] >= 4
    assert counted[("icebarrier_catalog_loads_not_modified_total", (("warehouse", "lease"),))] == 1


def test_a_tag_never_crosses_callers_or_grants(lake, server):
    """A tag taken by one caller is no pass for the next: a reader granted nothing gets the same
    403 as without the header, an anonymous client the same 401, neither a tag."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    p.advance(rows=3)
    name = f"{lake.namespace}.orders"
    whole = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}
    tag, _ = _fresh(server, "latest", name, whole)
    elsewhere = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn))}"}
    namespace, table = name.rsplit(".", 1)
    r = requests.get(
        f"{server}/v1/latest/namespaces/{namespace}/tables/{table}",
        headers={**elsewhere, "If-None-Match": tag},
        timeout=30,
    )
    assert r.status_code == 403 and "ETag" not in r.headers, r.text
    r = requests.get(
        f"{server}/v1/latest/namespaces/{namespace}/tables/{table}", headers={"If-None-Match": tag}, timeout=30
    )
    assert r.status_code == 401 and "ETag" not in r.headers, r.text


def test_a_view_load_is_tagged_and_a_replaced_view_gets_a_new_tag(lake, server):
    admin = ":".join(tokens.create(lake.conn, admin=True))
    catalog = rest(server, "latest", admin)
    catalog.create_view((lake.namespace, "v"), ROW, _version("SELECT 1", lake.namespace))
    headers = {"Authorization": f"Bearer {access_token(server, *admin.split(':'))}"}
    url = f"{server}/v1/latest/namespaces/{lake.namespace}/views/v"
    first = requests.get(url, headers=headers, timeout=30)
    tag = first.headers["ETag"]
    assert first.status_code == 200
    again = requests.get(url, headers={**headers, "If-None-Match": tag}, timeout=30)
    assert (again.status_code, again.content) == (304, b"")
    catalog.drop_view((lake.namespace, "v"))
    catalog.create_view((lake.namespace, "v"), ROW, _version("SELECT 2", lake.namespace))
    replaced = requests.get(url, headers={**headers, "If-None-Match": tag}, timeout=30)
    assert replaced.status_code == 200 and replaced.headers["ETag"] != tag


def test_the_rest_of_iceberg_1_11s_protocol(lake, server):
    """/v1/config advertises how long idempotency keys live; a load names the views it came
    through in ``referenced-by``, which is accepted (and changes nothing)."""
    p = Pipeline(lake, {"ingest": ["orders"]})
    p.advance(rows=3)
    headers = {"Authorization": f"Bearer {access_token(server, *tokens.create(lake.conn, whole_lake=True))}"}
    config = requests.get(f"{server}/v1/config", headers=headers, params={"warehouse": "latest"}, timeout=30).json()
    assert config["idempotency-key-lifetime"] == "PT30M", config
    url = f"{server}/v1/latest/namespaces/{lake.namespace}/tables/orders"
    plain = requests.get(url, headers=headers, timeout=30)
    via = requests.get(url, headers=headers, params={"referenced-by": f"{lake.namespace}\x1fv,other\x1fw"}, timeout=30)
    assert via.status_code == 200 and via.headers["ETag"] == plain.headers["ETag"]
