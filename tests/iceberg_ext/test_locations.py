"""Table locations are confined: under the warehouse (or an allowed prefix), never overlapping
another table's, for create, register, a commit's set-location and path properties; the probes
of issue 27 with job A's own token against job B's table, on a local warehouse and on S3."""

from __future__ import annotations

import json
import subprocess

import pyarrow as pa
import pytest
import requests
from psycopg import sql
from pyiceberg.exceptions import ForbiddenError, NoSuchTableError
from pyiceberg.table.update import SetLocationUpdate

from icebarrier.control_plane import tokens
from tests.iceberg_ext.catalog_server import Pipeline, access_token, free_port, rest, start_server, stop_server

pytestmark = pytest.mark.slow

SCHEMA = pa.schema([("id", pa.int64())])


@pytest.fixture(params=["local", "s3"])
def placed(request):
    """(lake, server URI) on a local warehouse, then on S3."""
    if request.param == "local":
        return request.getfixturevalue("lake"), request.getfixturevalue("server")
    return request.getfixturevalue("s3_lake"), request.getfixturevalue("s3_server")


def _files_under(lake, location: str) -> set[str]:
    from pyarrow.fs import FileSelector
    from pyiceberg.io.pyarrow import PyArrowFileIO

    scheme, netloc, path = PyArrowFileIO.parse_location(location)
    fs = PyArrowFileIO(lake.catalog.properties).fs_by_scheme(scheme, netloc)
    return {f.path for f in fs.get_file_info(FileSelector(path, recursive=True))}


def _refused(call, *words: str) -> str:
    with pytest.raises(ForbiddenError) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message.strip() and all(w in message for w in words), message
    return message


def test_a_job_cannot_place_its_tables_in_another_tables_location_or_outside_the_warehouse(placed):
    lake, server = placed
    Pipeline(lake, {"a": ["fa"], "b": ["fb"]}).advance()
    ns = lake.namespace
    b = lake.catalog.load_table(f"{ns}.fb")
    owner = f"lake.{ns}.fb"
    jid, secret = tokens.create(lake.conn, job=f"{ns}_a", whole_lake=True)
    a = rest(server, "latest", f"{jid}:{secret}")
    before = _files_under(lake, b.location())
    outside = (
        "file:///etc/icebarrier-probe"
        if lake.settings.warehouse.startswith("file:")
        else lake.settings.warehouse.rsplit("/", 1)[0] + "/elsewhere/probe"
    )

    # create: in B's directory, under it, above it; outside the warehouse; a path property into B's
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=b.location()), "overlaps", owner)
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=b.location() + "/data/x"), owner)
    _refused(
        lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=b.location().rsplit("/", 1)[0]), "overlaps table"
    )
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=b.location() + "/../fb"), "'..'")
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=outside), "outside the warehouse")
    _refused(
        lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, properties={"write.data.path": b.location() + "/data"}),
        "write.data.path",
        owner,
    )
    _refused(lambda: a.create_table_transaction(f"{ns}.probe", schema=SCHEMA, location=b.location()), owner)

    # register B's current metadata file under a name of A's
    _refused(lambda: a.register_table(f"{ns}.copy", b.metadata_location), "lies under", owner)

    # a commit moving A's own table: to a place of its own, then into B's location
    a.create_table(f"{ns}.mine", schema=SCHEMA)
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}"}
    mine = f"{server}/v1/latest/namespaces/{ns}/tables/mine"

    def move(location: str) -> requests.Response:
        return requests.post(
            mine,
            json={"requirements": [], "updates": [{"action": "set-location", "location": location}]},
            headers=auth,
            timeout=30,
        )

    own = b.location().rsplit("/", 1)[0] + "/mine-moved"
    assert move(own).status_code == 200
    refused = move(b.location())
    assert refused.status_code == 403 and owner in refused.json()["error"]["message"], refused.text

    for name in ("probe", "copy"):
        with pytest.raises(NoSuchTableError):
            a.load_table(f"{ns}.{name}")
    assert a.load_table(f"{ns}.mine").location() == own
    assert _files_under(lake, b.location()) == before  # nothing of A's landed in B's directory


def test_db_status_lists_overlaps_earlier_versions_let_in(lake):
    """Two tables placed at one location behind the catalog's back (what an earlier version
    served): `icebarrier db status` names both."""
    Pipeline(lake, {"b": ["fb"]})
    b = lake.catalog.load_table(f"{lake.namespace}.fb")
    lake.catalog.create_table(f"{lake.namespace}.squatter", schema=SCHEMA, location=b.location() + "/data/sq")
    done = subprocess.run(["icebarrier", "--output", "json", "db", "status"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    pairs = json.loads(done.stdout)["overlapping_locations"]
    assert {"table": f"lake.{lake.namespace}.squatter", "under": f"lake.{lake.namespace}.fb"}.items() <= next(
        p for p in pairs if p["under"] == f"lake.{lake.namespace}.fb"
    ).items()


def _marks(lake) -> int:
    return lake.conn.execute(
        sql.SQL("SELECT count(*) AS n FROM {} WHERE table_namespace = %s").format(
            sql.Identifier(lake.settings.catalog_schema, "icebarrier_placement_mark")
        ),
        (lake.namespace,),
    ).fetchone()["n"]


def test_placements_follow_every_writer_of_the_catalog_and_a_commit_marks_nothing(lake, server):
    """The server checks a location against the catalog's placements (an index, not every table):
    they follow tables that another writer of the SQL catalog creates, moves, renames and drops,
    and tables written before they existed (`db upgrade` places them); an append marks nothing."""
    ns = lake.namespace
    jid, secret = tokens.create(lake.conn, job=f"{ns}_a", whole_lake=True)
    Pipeline(lake, {"a": ["fa"]})
    a = rest(server, "latest", f"{jid}:{secret}")
    other = lake.catalog.create_table(f"{ns}.other", schema=SCHEMA)  # not through the server
    first = other.location()
    other.append(pa.table({"id": [1]}, schema=SCHEMA))
    assert _marks(lake) == 2  # its creation and fa's, until a placement places them
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=first + "/x"), f"lake.{ns}.other")
    a.create_table(f"{ns}.beside", schema=SCHEMA)
    assert _marks(lake) == 1  # placed (a refused placement leaves the marks): only beside's own
    other.append(pa.table({"id": [2]}, schema=SCHEMA))
    assert _marks(lake) == 1  # the next metadata file beside the last: the same location

    moved = first.rsplit("/", 1)[0] + "/other-moved"
    lake.catalog.commit_table(other, (), (SetLocationUpdate(location=moved),))  # as Spark's SET LOCATION
    a.create_table(f"{ns}.in_the_old_place", schema=SCHEMA, location=first + "-old/t")
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=moved), f"lake.{ns}.other")

    lake.catalog.rename_table(f"{ns}.other", f"{ns}.renamed")
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=moved + "/y"), f"lake.{ns}.renamed")
    lake.catalog.drop_table(f"{ns}.renamed")
    a.create_table(f"{ns}.in_its_place", schema=SCHEMA, location=moved)

    # A catalog written before placements were kept: its rows are placed by `db upgrade`.
    for kept in ("icebarrier_placement", "icebarrier_placement_mark"):
        lake.conn.execute(
            sql.SQL("DELETE FROM {} WHERE table_namespace = %s").format(
                sql.Identifier(lake.settings.catalog_schema, kept)
            ),
            (ns,),
        )
    a.create_table(f"{ns}.unseen", schema=SCHEMA, location=moved + "/z")  # what the check cannot see
    lake.catalog.drop_table(f"{ns}.unseen")
    done = subprocess.run(["icebarrier", "db", "upgrade"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=moved + "/z"), f"lake.{ns}.in_its_place")
    with pytest.raises(NoSuchTableError):
        a.load_table(f"{ns}.probe")


def test_a_server_on_a_catalog_without_placements_refuses_to_start_until_db_upgrade(own_lake):
    """The location check reads the catalog's placements: a server started before `db upgrade`
    made them says so in one line and exits; after `db upgrade` it serves."""
    placements = sql.Identifier(own_lake.settings.catalog_schema, "icebarrier_placement")
    own_lake.conn.execute(sql.SQL("DROP TABLE {}").format(placements))
    serve = ["icebarrier", "serve", "--port", str(free_port())]
    refused = subprocess.run(serve, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1, refused.stderr
    assert "icebarrier db upgrade" in refused.stderr and "placements" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr, refused.stderr
    done = subprocess.run(["icebarrier", "db", "upgrade"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    proc, _ = start_server(own_lake)
    assert "Traceback" not in stop_server(proc)


def test_a_table_registered_again_after_its_drop_is_placed_and_pointed_at_in_one_transaction(lake, server):
    """A dropped table leaves a mark; registering its metadata again under its name places the
    marked row and inserts the pointer in the request's one transaction (before, the insert went
    through PyIceberg's own connection and waited forever for the mark the placement held)."""
    ns = lake.namespace
    jid, secret = tokens.create(lake.conn, job=f"{ns}_a", whole_lake=True)
    Pipeline(lake, {"a": ["fa"]})
    a = rest(server, "latest", f"{jid}:{secret}")
    table = a.create_table(f"{ns}.again", schema=SCHEMA)
    a.drop_table(f"{ns}.again")  # without purge: its files stay
    registered = requests.post(
        f"{server}/v1/latest/namespaces/{ns}/register",
        json={"name": "again", "metadata-location": table.metadata_location},
        headers={"Authorization": f"Bearer {access_token(server, jid, secret)}"},
        timeout=30,
    )
    assert registered.status_code == 200, registered.text
    assert a.load_table(f"{ns}.again").metadata_location == table.metadata_location
    _refused(lambda: a.create_table(f"{ns}.probe", schema=SCHEMA, location=table.location() + "/x"), f"lake.{ns}.again")


def test_a_table_created_where_a_renamed_table_lives_gets_a_folder_of_its_own(lake, server):
    """A rename keeps the table's folder; a new table under the old name (no location given) is
    placed beside it with a suffix of its own, not refused, and dropping it with purge leaves the
    renamed table whole (Iceberg 1.11's REST Compatibility Kit: dropAfterRenameDoesntCorruptTable)."""
    ns = lake.namespace
    Pipeline(lake, {"writer": ["managed"]})  # a job's whole-lake token writes tables no job owns
    client = rest(server, "latest", ":".join(tokens.create(lake.conn, job=f"{ns}_writer", whole_lake=True)))
    first = client.create_table(f"{ns}.old", schema=SCHEMA)
    first.append(pa.table({"id": [1, 2]}, schema=SCHEMA))
    client.rename_table(f"{ns}.old", f"{ns}.renamed")
    second = client.create_table(f"{ns}.old", schema=SCHEMA)
    assert second.location().startswith(f"{first.location()}-") and len(second.location()) == len(first.location()) + 9
    second.append(pa.table({"id": [3]}, schema=SCHEMA))
    client.purge_table(f"{ns}.old")
    assert client.load_table(f"{ns}.renamed").scan().to_arrow().num_rows == 2
    third = client.create_table(f"{ns}.fresh", schema=SCHEMA)  # a free folder: no suffix
    assert third.location().endswith(f"/{ns}/fresh")
