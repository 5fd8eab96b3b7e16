"""Names and values: parsing refuses anything that could inject SQL or paths."""

import pytest

from icebarrier.control_plane.errors import InvalidNameError, InvalidValueError
from icebarrier.control_plane.model import (
    TableName,
    namespace_from_sql,
    parse_duration_s,
    parse_external_input,
    parse_job_name,
    parse_schema_name,
    sql_namespace,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lake.db.orders", "lake.db.orders"),
        ("Lake.DB.Orders", "lake.db.orders"),
        ("lake.a.b.orders", "lake.a.b.orders"),
        (" lake.db.t_1 ", "lake.db.t_1"),
        ("lake.`new.db`.`ta.ble`", "lake.`new.db`.`ta.ble`"),
        ("lake.`db`.`Orders`", "lake.db.`Orders`"),
        ("lake.`a``b`.`c d`", "lake.`a``b`.`c d`"),
    ],
)
def test_table_names_parse_and_normalise(text, expected):
    """Plain parts are lower-cased, quoted ones kept verbatim (a backtick doubled); nested
    namespaces allowed; a part is quoted back only when it must be."""
    assert str(TableName.parse(text)) == expected


def test_a_dotted_level_is_one_level_and_stored_escaped():
    """`a.b` is one level, a.b two: distinct names, identifiers and SQL catalog namespaces, each
    read back as it was."""
    one, two = TableName.parse("lake.`a.b`.t"), TableName.parse("lake.a.b.t")
    assert one.namespace == ("a.b",) and two.namespace == ("a", "b")
    assert one.identifier == ("a%2Eb", "t") and two.identifier == ("a", "b", "t")
    assert one.sql_namespace == "a%2Eb" != two.sql_namespace == "a.b"
    for levels in [("a.b",), ("a", "b"), ("50%",), ("%2E",), ("x.%.y", "z")]:
        assert namespace_from_sql(sql_namespace(levels)) == levels
        name = TableName(catalog="lake", namespace=levels, name="ta.ble")
        assert TableName.parse(str(name)) == name
        assert TableName.from_sql_catalog("lake", name.sql_namespace, "ta.ble") == name


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
        "lake.`db.t",
        "lake.db.`t`x",
        "`lake`x.db.t",
    ],
)
def test_invalid_table_names_are_refused(text):
    """Malformed names are refused with a message that shows the expected form."""
    with pytest.raises(InvalidNameError, match="catalog.namespace.table"):
        TableName.parse(text)


@pytest.mark.parametrize(
    "text", ["lake.db." + "x" * 200, "lake.`..`.t", "lake.db.`.`", "lake.db.`a/b`", "lake.db.`a\nb`"]
)
def test_names_against_the_rule_are_refused_naming_it(text):
    """Well-formed, but a part breaks the names rule: too long, a walking path, '/', a control character."""
    with pytest.raises(InvalidNameError, match="not '.' or '..', without '/' or control characters"):
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
