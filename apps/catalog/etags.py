"""Cached loads: the spec's ``ETag`` on a table's or a view's load, and ``If-None-Match`` answered
``304 Not Modified`` without a body. An Iceberg 1.11+ client keeps each loaded table with its tag
(per catalog session and table) and sends the tag with its next load of that table; on a 304 it
uses what it kept.

The tag is a digest of the whole answer's bytes: the metadata served, ``config`` and the storage
credentials. Two answers share a tag only if they are the same bytes, in any server process, so
a 304 is never wrong: the same table through ``latest``, ``barrier-<B>`` and ``read-committed``
(up to three metadata files), a read-committed session whose moment moved, a commit, renewed
credentials each make a new tag. Hashing costs less than sending (BLAKE2b: about 1 ms a MB of
metadata, a few microseconds for a small table's).
"""

from __future__ import annotations

import hashlib

from starlette.responses import Response


def entity_tag(body: bytes) -> str:
    """A strong tag of ``body`` (RFC 9110 8.8.3: a quoted string)."""
    return f'"{hashlib.blake2b(body, digest_size=16).hexdigest()}"'


def not_modified(if_none_match: str | None, tag: str) -> bool:
    """Whether ``If-None-Match`` lists ``tag`` (compared weakly, as RFC 9110 13.1.2 has it for
    this header) or is ``*``. A stale, foreign or malformed value lists no tag of ours: False."""
    if not if_none_match:
        return False
    listed = (candidate.strip() for candidate in if_none_match.split(","))
    return any(candidate == "*" or candidate.removeprefix("W/") == tag for candidate in listed)


def cached_json(body: bytes, if_none_match: str | None) -> Response:
    """A load's answer: ``body`` with its tag, or 304 with the tag alone if the client has it."""
    tag = entity_tag(body)
    if not_modified(if_none_match, tag):
        return Response(status_code=304, headers={"ETag": tag})
    return Response(body, media_type="application/json", headers={"ETag": tag})
