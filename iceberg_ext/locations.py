"""Where tables live: every table location lies under the warehouse (or a prefix the server is
told to allow), and no two tables' locations overlap, so nothing that cleans one table (purge,
orphan-file removal, expiry) touches another's files.

A table's location is its metadata's ``location``; for the catalog's tables it is read off the
pointer (``<location>/metadata/<file>.metadata.json``, how every writer names metadata unless
``write.metadata.path`` moves it) and from the metadata file only where the pointer does not
have that form. Locations compare normalized: one scheme per store (``s3a``/``s3n`` are
``s3``; a local path is ``file://``), no empty, ``.`` or ``..`` segments, no trailing ``/``.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from psycopg import sql
from psycopg.rows import tuple_row

from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import TableName

# Table properties that place files outside the table's location: confined like it.
PATH_PROPERTIES = ("write.data.path", "write.metadata.path", "write.object-storage.path", "write.folder-storage.path")
_SAME_STORE = {"s3a": "s3", "s3n": "s3", "": "file"}


class LocationRefusedError(IcebarrierError):
    """A table location outside the allowed prefixes, or overlapping another table's (403)."""


def normalized(location: str) -> str:
    """``location`` in the one form locations compare in; a malformed one is refused."""
    parts = urlsplit(location.strip())
    scheme = _SAME_STORE.get(parts.scheme.lower(), parts.scheme.lower())
    path = unquote(parts.path)
    segments = path.split("/")
    if any(s in (".", "..") for s in segments) or parts.query or parts.fragment:
        raise LocationRefusedError(f"location {location!r} has '.', '..', '?' or '#' in its path; give it plainly")
    if scheme != "file" and not parts.netloc:
        raise LocationRefusedError(f"location {location!r} names no bucket; give scheme://bucket/path")
    path = posixpath.normpath("/" + path.lstrip("/")).rstrip("/")
    return f"{scheme}://{parts.netloc}{path}"


def contains(outer: str, inner: str) -> bool:
    """Whether normalized ``inner`` is ``outer`` or lies under it."""
    return inner == outer or inner.startswith(outer + "/")


def overlap(a: str, b: str) -> bool:
    return contains(a, b) or contains(b, a)


def location_of_pointer(metadata_location: str) -> str | None:
    """The table location a metadata pointer implies (``<location>/metadata/<file>``), if it has that form."""
    head, sep, file = metadata_location.rpartition("/metadata/")
    return head if sep and head and "/" not in file else None


@dataclass(frozen=True, slots=True)
class Placed:
    """A table (its name as the catalog spells it) and its normalized location."""

    table: str
    location: str


def catalog_rows(conn, catalog_schema: str, catalog: str) -> list[tuple[str | None, str, str]]:
    """(SQL namespace, name, metadata location) of every table of the catalog, and (None, table,
    metadata location) of every sink a job session created and has not published (its location
    is taken too)."""
    with conn.cursor(row_factory=tuple_row) as cur:
        return cur.execute(
            sql.SQL(
                "SELECT table_namespace, table_name, metadata_location "
                "FROM {}.iceberg_tables WHERE catalog_name = %s AND metadata_location IS NOT NULL "
                "UNION ALL SELECT NULL, table_name, metadata_location FROM catalog_pending WHERE base_location IS NULL"
            ).format(sql.Identifier(catalog_schema)),
            (catalog,),
        ).fetchall()


UNPLACEABLE = (IcebarrierError, OSError, ValueError)  # a table whose metadata cannot be read places nothing
LOCK = "table_location"  # the advisory lock that keeps two placements from passing the check at once


def _shown(catalog: str, namespace: str | None, name: str) -> str:
    """The table as icebarrier names it (a session's sink, ``namespace`` None: named so already)."""
    return name if namespace is None else str(TableName.from_sql_catalog(catalog, namespace, name))


def place(catalog: str, row: tuple[str | None, str, str], read_location: Callable[[str], str]) -> Placed:
    """A row of :func:`catalog_rows` as a table and its normalized location;
    ``read_location(metadata_location)`` reads one off its metadata file where the pointer does not
    say it (raises one of :data:`UNPLACEABLE` where that fails: the table's load fails on its own)."""
    namespace, name, pointer = row
    return Placed(_shown(catalog, namespace, name), normalized(location_of_pointer(pointer) or read_location(pointer)))


def placeable(
    catalog: str, rows: Iterable[tuple[str | None, str, str]], read_location: Callable[[str], str]
) -> Iterator[tuple[tuple[str | None, str, str], Placed]]:
    """Each of ``rows`` with its :func:`place`; a row that cannot be placed places nothing."""
    for row in rows:
        try:
            yield row, place(catalog, row, read_location)
        except UNPLACEABLE:
            continue


def catalog_tables(conn, catalog_schema: str, catalog: str, read_location: Callable[[str], str]) -> list[Placed]:
    """Every table's normalized location, each of :func:`catalog_rows` read and placed: what
    ``db status`` audits."""
    return [p for _, p in placeable(catalog, catalog_rows(conn, catalog_schema, catalog), read_location)]


# The catalog's placements (iceberg_ext/catalog.py, _PLACEMENTS): a row a table, kept by placing
# again the rows the SQL catalog's trigger marked. `refresh` and `near` run under LOCK; `inside`
# only reads, without it.


# the marked tables' pointer rows as they are now (None: the table is gone), from ``marked``
_MARKED_POINTERS = (
    "SELECT m.table_namespace, m.table_name, t.metadata_location FROM marked m "
    "LEFT JOIN {cs}.iceberg_tables t ON t.catalog_name = %(c)s "
    "AND t.table_namespace = m.table_namespace AND t.table_name = m.table_name"
)


def refresh(conn, catalog_schema: str, catalog: str, read_location: Callable[[str], str]) -> int:
    """Place again every table of ``catalog`` marked since the last placement (its pointer row as
    it is now; a table gone or unplaceable places nothing); how many were marked."""
    cs = sql.Identifier(catalog_schema)
    with conn.cursor(row_factory=tuple_row) as cur:
        marked = cur.execute(
            sql.SQL(
                "WITH marked AS (DELETE FROM {cs}.icebarrier_placement_mark WHERE catalog_name = %(c)s "
                "RETURNING table_namespace, table_name) " + _MARKED_POINTERS
            ).format(cs=cs),
            {"c": catalog},
        ).fetchall()
        if not marked:
            return 0
        present = (row for row in marked if row[2] is not None)  # a table gone places nothing
        placed = [(ns, name, p.location) for (ns, name, _), p in placeable(catalog, present, read_location)]
        cur.execute(
            sql.SQL(
                "DELETE FROM {cs}.icebarrier_placement WHERE catalog_name = %s "
                "AND (table_namespace, table_name) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"
            ).format(cs=cs),
            (catalog, [m[0] for m in marked], [m[1] for m in marked]),
        )
        cur.execute(
            sql.SQL(
                "INSERT INTO {cs}.icebarrier_placement SELECT %s, * FROM unnest(%s::text[], %s::text[], %s::text[])"
            ).format(cs=cs),
            (catalog, *([p[i] for p in placed] for i in range(3))),
        )
    return len(marked)


def near(conn, catalog_schema: str, catalog: str, spot: str, read_location: Callable[[str], str]) -> list[Placed]:
    """The tables whose locations may overlap normalized ``spot`` (more, never fewer: the caller
    tests each): the placements at ``spot`` or at one of its ancestors (by equality) and under it
    (a range of the index), and every sink a job session created and has not published."""
    start = spot.index("://") + len("://")
    ancestors = [spot[:i] for i in range(start, len(spot)) if spot[i] == "/"] + [spot]
    with conn.cursor(row_factory=tuple_row) as cur:
        rows = cur.execute(
            sql.SQL(
                "SELECT table_namespace, table_name, location FROM {}.icebarrier_placement "
                "WHERE catalog_name = %(c)s AND (location = ANY(%(ancestors)s) "
                "OR (location >= %(under)s || '/' AND location < %(under)s || '0')) "  # '0' follows '/'
                "UNION ALL SELECT NULL, table_name, metadata_location FROM catalog_pending WHERE base_location IS NULL"
            ).format(sql.Identifier(catalog_schema)),
            {"c": catalog, "ancestors": ancestors, "under": spot},
        ).fetchall()
    pending = [row for row in rows if row[0] is None]  # (None, sink, its metadata location)
    found = [Placed(_shown(catalog, ns, name), location) for ns, name, location in rows if ns is not None]
    return found + [p for _, p in placeable(catalog, pending, read_location)]


def inside(conn, catalog_schema: str, catalog: str, spot: str, read_location: Callable[[str], str]) -> list[Placed]:
    """The tables that may live under normalized ``spot`` (not at it), without the lock or a write:
    the placements under it (:func:`near`), and the tables marked since the last placement,
    placed now (more, never fewer: a placement gone stale names a folder to keep, which errs on
    the side of keeping files). What orphan removal keeps out of a table's listing; the
    placements are brought up to date by the next table placed."""
    with conn.cursor(row_factory=tuple_row) as cur:
        marked = cur.execute(
            sql.SQL(
                "WITH marked AS (SELECT table_namespace, table_name FROM {cs}.icebarrier_placement_mark "
                "WHERE catalog_name = %(c)s) " + _MARKED_POINTERS
            ).format(cs=sql.Identifier(catalog_schema)),
            {"c": catalog},
        ).fetchall()
    present = (row for row in marked if row[2] is not None)
    found = [
        *near(conn, catalog_schema, catalog, spot, read_location),
        *(p for _, p in placeable(catalog, present, read_location)),
    ]
    return [p for p in found if p.location != spot and contains(spot, p.location)]


def reader(properties: dict[str, str]) -> Callable[[str], str]:
    """``read_location`` for :func:`place` from PyIceberg's FileIO with ``properties``."""

    def read(metadata_location: str) -> str:
        from pyiceberg.io import load_file_io
        from pyiceberg.serializers import FromInputFile

        io = load_file_io(properties, metadata_location)
        return FromInputFile.table_metadata(io.new_input(metadata_location)).location

    return read


def overlapping(tables: list[Placed]) -> list[tuple[Placed, Placed]]:
    """Every pair of tables whose locations overlap (what earlier versions let in)."""
    pairs: list[tuple[Placed, Placed]] = []
    open_: list[Placed] = []  # open_: the chain of locations containing the current one
    for t in sorted(tables, key=lambda p: (p.location + "/", p.table)):
        while open_ and not contains(open_[-1].location, t.location):
            open_.pop()
        pairs.extend((outer, t) for outer in open_)
        open_.append(t)
    return pairs


# The tables whose locations may overlap a normalized location (:func:`near`, at least those).
Near = Callable[[str], Iterable[Placed]]


@dataclass(frozen=True, slots=True)
class Confinement:
    """The prefixes table locations may lie under (the warehouse first)."""

    allowed: tuple[str, ...]

    @classmethod
    def of(cls, warehouse: str, extra: Iterable[str] = ()) -> Confinement:
        return cls(tuple(normalized(p) for p in (warehouse, *extra)))

    def check(self, table: str, location: str, near: Near, *, what: str = "location") -> str:
        """Refuse ``location`` for ``table`` unless it lies strictly under an allowed prefix and
        overlaps no other table's location; its normalized form."""
        spot = self.allowed_spot(table, location, what)
        for other in near(spot):
            if other.table != table and overlap(spot, other.location):
                raise LocationRefusedError(
                    f"{what} {location} of table {table} overlaps table {other.table} (at {other.location}); "
                    f"give the table a location of its own"
                )
        return spot

    def allowed_spot(self, table: str, location: str, what: str) -> str:
        spot = normalized(location)
        if not any(spot.startswith(prefix + "/") for prefix in self.allowed):
            where = self.allowed[0] + (f" (or {', '.join(self.allowed[1:])})" if len(self.allowed) > 1 else "")
            raise LocationRefusedError(
                f"{what} {location} of table {table} is outside the warehouse {where}; place the table under "
                f"it, or start `icebarrier serve` with --allowed-location for that prefix"
            )
        return spot

    def check_file(self, table: str, file: str, near: Near) -> None:
        """Refuse a metadata file of ``table`` outside the allowed prefixes or under another
        table's location."""
        spot = self.allowed_spot(table, file, "metadata-location")
        for other in near(spot):
            if other.table != table and contains(other.location, spot):
                raise LocationRefusedError(
                    f"metadata-location {file} lies under table {other.table}'s location {other.location}; "
                    f"a table is registered from metadata of its own"
                )
