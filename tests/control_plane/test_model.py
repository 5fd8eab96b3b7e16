"""Names and values: parsing refuses anything that could inject SQL or paths."""

import pytest

from icebarrier.control_plane.errors import InvalidNameError, InvalidValueError
from icebarrier.control_plane.model import (
    TableName,
    parse_duration_s,
    parse_external_input,
    parse_job_name,
    parse_schema_name,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lake.db.orders", "lake.db.orders"),
        ("Lake.DB.Orders", "lake.db.orders"),
        ("lake.a.b.orders", "lake.a.b.orders"),
        (" lake.db.t_1 ", "lake.db.t_1"),
    ],
)
def test_table_names_parse_and_normalise(text, expected):
    """Valid identifiers parse and are lower-cased, nested namespaces allowed."""
    assert str(TableName.parse(text)) == expected


@pytest.mark.parametrize(
    "text",
    [
        "orders",
        "db.orders",
        "lake..orders",
        "lake.db.orders;drop table x",
        "lake.db.'x'",
        "lake.db.../etc",
        "lake.db.1abc",
        "lake.db.a b",
        "lake.db.",
        "",
        "lake.db." + "x" * 200,
    ],
)
def test_invalid_table_names_are_refused(text):
    """Malformed names are refused with a message that shows the expected form."""
    with pytest.raises(InvalidNameError, match="catalog.namespace.table"):
        TableName.parse(text)


def test_table_identifier_for_pyiceberg():
    """The identifier inside the catalog drops the catalog part."""
    assert TableName.parse("lake.a.b.t").identifier == ("a", "b", "t")


@pytest.mark.parametrize("bad", ["", "1job", "a b", "x;drop", "a'b", "j" * 129])
def test_invalid_job_names_are_refused(bad):
    """Job names are identifiers with - and . allowed."""
    with pytest.raises(InvalidNameError):
        parse_job_name(bad)


def test_valid_names_pass():
    """Typical job, input and schema names are accepted unchanged."""
    assert parse_job_name("ingest-orders.v2") == "ingest-orders.v2"
    assert parse_external_input("kafka:orders") == "kafka:orders"
    assert parse_external_input("s3://bucket/path/in") == "s3://bucket/path/in"
    assert parse_schema_name("icebarrier_prod") == "icebarrier_prod"


@pytest.mark.parametrize("bad", ["pg_catalog", "x;y", "a-b", ""])
def test_invalid_schema_names_are_refused(bad):
    """Schema names are plain identifiers and never pg_*."""
    with pytest.raises(InvalidNameError):
        parse_schema_name(bad)


@pytest.mark.parametrize(
    "text, seconds", [("500ms", 0.5), ("10s", 10), ("10m", 600), ("1.5h", 5400), ("2d", 172800), ("7", 7)]
)
def test_durations(text, seconds):
    """Durations take ms, s, m, h, d or plain seconds."""
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("bad", ["", "0s", "-1s", "10 minutes", "abc"])
def test_bad_durations_are_refused(bad):
    """Zero, negative and unknown units are refused."""
    with pytest.raises(InvalidValueError, match="duration"):
        parse_duration_s(bad)
