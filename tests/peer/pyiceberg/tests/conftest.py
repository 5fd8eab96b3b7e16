# Licensed to the Apache Software Foundation (ASF) under one
# or more contributor license agreements.  See the NOTICE file
# distributed with this work for additional information
# regarding copyright ownership.  The ASF licenses this file
# to you under the Apache License, Version 2.0 (the
# "License"); you may not use this file except in compliance
# with the License.  You may obtain a copy of the License at
#
#   http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing,
# software distributed under the License is distributed on an
# "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY
# KIND, either express or implied.  See the License for the
# specific language governing permissions and limitations
# under the License.
# pylint:disable=redefined-outer-name
"""A trimmed copy of PyIceberg's ``tests/conftest.py`` (tag pyiceberg-0.12.0rc1): only the
fixtures and helpers that ``tests/integration/test_catalog.py`` uses, copied unchanged (the
blocks keep their order; the full file imports boto3, moto and a dozen storage back-ends at
module level, none of which this suite needs). See ../README.md."""

import string
from pathlib import Path
from random import choice
from typing import Any

import pytest

from pyiceberg.catalog import Catalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table.sorting import NullOrder, SortField, SortOrder
from pyiceberg.transforms import DayTransform, IdentityTransform
from pyiceberg.types import (
    BooleanType,
    FloatType,
    IntegerType,
    ListType,
    MapType,
    NestedField,
    StringType,
    StructType,
    TimestampType,
)
from pyiceberg.utils.properties import property_as_bool


@pytest.fixture(scope="session")
def table_schema_simple() -> Schema:
    return Schema(
        NestedField(field_id=1, name="foo", field_type=StringType(), required=False),
        NestedField(field_id=2, name="bar", field_type=IntegerType(), required=True),
        NestedField(field_id=3, name="baz", field_type=BooleanType(), required=False),
        schema_id=1,
        identifier_field_ids=[2],
    )


@pytest.fixture(scope="session")
def table_schema_nested() -> Schema:
    return Schema(
        NestedField(field_id=1, name="foo", field_type=StringType(), required=False),
        NestedField(field_id=2, name="bar", field_type=IntegerType(), required=True),
        NestedField(field_id=3, name="baz", field_type=BooleanType(), required=False),
        NestedField(
            field_id=4,
            name="qux",
            field_type=ListType(element_id=5, element_type=StringType(), element_required=True),
            required=True,
        ),
        NestedField(
            field_id=6,
            name="quux",
            field_type=MapType(
                key_id=7,
                key_type=StringType(),
                value_id=8,
                value_type=MapType(key_id=9, key_type=StringType(), value_id=10, value_type=IntegerType(), value_required=True),
                value_required=True,
            ),
            required=True,
        ),
        NestedField(
            field_id=11,
            name="location",
            field_type=ListType(
                element_id=12,
                element_type=StructType(
                    NestedField(field_id=13, name="latitude", field_type=FloatType(), required=False),
                    NestedField(field_id=14, name="longitude", field_type=FloatType(), required=False),
                ),
                element_required=True,
            ),
            required=True,
        ),
        NestedField(
            field_id=15,
            name="person",
            field_type=StructType(
                NestedField(field_id=16, name="name", field_type=StringType(), required=False),
                NestedField(field_id=17, name="age", field_type=IntegerType(), required=True),
            ),
            required=False,
        ),
        schema_id=1,
        identifier_field_ids=[2],
    )


@pytest.fixture
def example_view_metadata_v1() -> dict[str, Any]:
    return {
        "view-uuid": "a20125c8-7284-442c-9aea-15fee620737c",
        "format-version": 1,
        "location": "s3://bucket/test/location/test_view",
        "current-version-id": 1,
        "versions": [
            {
                "version-id": 1,
                "timestamp-ms": 1602638573874,
                "schema-id": 1,
                "summary": {"engine-name": "spark", "engineVersion": "3.3"},
                "representations": [
                    {
                        "type": "sql",
                        "sql": "SELECT * FROM prod.db.table",
                        "dialect": "spark",
                    }
                ],
                "default-namespace": ["default"],
            }
        ],
        "schemas": [
            {
                "type": "struct",
                "schema-id": 1,
                "fields": [
                    {"id": 1, "name": "x", "required": True, "type": "long"},
                    {"id": 2, "name": "y", "required": True, "type": "long", "doc": "comment"},
                    {"id": 3, "name": "z", "required": True, "type": "long"},
                ],
            }
        ],
        "version-log": [{"timestamp-ms": 1602638573874, "version-id": 1}],
        "properties": {"comment": "this is a test view"},
    }


@pytest.fixture(scope="session")
def test_schema() -> Schema:
    return Schema(
        NestedField(1, "VendorID", IntegerType(), False), NestedField(2, "tpep_pickup_datetime", TimestampType(), False)
    )


@pytest.fixture(scope="session")
def test_partition_spec() -> PartitionSpec:
    return PartitionSpec(
        PartitionField(1, 1000, IdentityTransform(), "VendorID"),
        PartitionField(2, 1001, DayTransform(), "tpep_pickup_day"),
    )


@pytest.fixture(scope="session")
def test_sort_order() -> SortOrder:
    return SortOrder(SortField(source_id=1, transform=IdentityTransform(), null_order=NullOrder.NULLS_FIRST))


NUM_TABLES = 2



RANDOM_LENGTH = 8  # Keep short to stay within Windows MAX_PATH (260 chars)
NUM_TABLES = 2


@pytest.fixture()
def table_name() -> str:
    prefix = "my_iceberg_table-"
    random_tag = "".join(choice(string.ascii_letters) for _ in range(RANDOM_LENGTH))
    return (prefix + random_tag).lower()


@pytest.fixture()
def table_list(table_name: str) -> list[str]:
    return [f"{table_name}_{idx}" for idx in range(NUM_TABLES)]


@pytest.fixture()
def view_name() -> str:
    prefix = "my_iceberg_view-"
    random_tag = "".join(choice(string.ascii_letters) for _ in range(RANDOM_LENGTH))
    return (prefix + random_tag).lower()


@pytest.fixture()
def database_name() -> str:
    prefix = "my_iceberg_database-"
    random_tag = "".join(choice(string.ascii_letters) for _ in range(RANDOM_LENGTH))
    return (prefix + random_tag).lower()


@pytest.fixture()
def database_list(database_name: str) -> list[str]:
    return [f"{database_name}_{idx}" for idx in range(NUM_TABLES)]


def clean_up(test_catalog: Catalog) -> None:
    """Clean all databases and tables created during the integration test."""
    for database_tuple in test_catalog.list_namespaces():
        database_name = database_tuple[0]
        if "my_iceberg_database-" in database_name:
            for identifier in test_catalog.list_tables(database_name):
                test_catalog.drop_table(identifier)
            try:
                for identifier in test_catalog.list_views(database_name):
                    test_catalog.drop_view(identifier)
            except NotImplementedError:
                pass
            test_catalog.drop_namespace(database_name)


@pytest.fixture(scope="session")
def warehouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("test_sql")


def does_support_purge_table(catalog: Catalog) -> bool:
    from pyiceberg.catalog.noop import NoopCatalog
    from pyiceberg.catalog.rest import RestCatalog

    if isinstance(catalog, RestCatalog):
        return property_as_bool(catalog.properties, "supports_purge_table", True)
    from pyiceberg.catalog.hive import HiveCatalog

    if isinstance(catalog, (HiveCatalog, NoopCatalog)):
        return False
    return True


def does_support_atomic_concurrent_updates(catalog: Catalog) -> bool:
    from pyiceberg.catalog.noop import NoopCatalog
    from pyiceberg.catalog.rest import RestCatalog

    if isinstance(catalog, RestCatalog):
        return property_as_bool(catalog.properties, "supports_atomic_concurrent_updates", True)
    from pyiceberg.catalog.hive import HiveCatalog

    if isinstance(catalog, (HiveCatalog, NoopCatalog)):
        return False
    return True


def does_support_nested_namespaces(catalog: Catalog) -> bool:
    from pyiceberg.catalog.dynamodb import DynamoDbCatalog
    from pyiceberg.catalog.glue import GlueCatalog
    from pyiceberg.catalog.noop import NoopCatalog
    from pyiceberg.catalog.rest import RestCatalog

    if isinstance(catalog, RestCatalog):
        return property_as_bool(catalog.properties, "supports_nested_namespaces", True)
    from pyiceberg.catalog.bigquery_metastore import BigQueryMetastoreCatalog
    from pyiceberg.catalog.hive import HiveCatalog

    if isinstance(catalog, (HiveCatalog, BigQueryMetastoreCatalog, NoopCatalog, GlueCatalog, DynamoDbCatalog)):
        return False
    return True


def does_support_schema_evolution(catalog: Catalog) -> bool:
    from pyiceberg.catalog.noop import NoopCatalog
    from pyiceberg.catalog.rest import RestCatalog

    if isinstance(catalog, RestCatalog):
        return property_as_bool(catalog.properties, "supports_schema_evolution", True)
    from pyiceberg.catalog.hive import HiveCatalog

    if isinstance(catalog, (HiveCatalog, NoopCatalog)):
        return False
    return True


def does_support_slash_in_identifier(catalog: Catalog) -> bool:
    from pyiceberg.catalog.noop import NoopCatalog
    from pyiceberg.catalog.rest import RestCatalog
    from pyiceberg.catalog.sql import SqlCatalog

    if isinstance(catalog, RestCatalog):
        return property_as_bool(catalog.properties, "supports_slash_in_identifier", False)
    from pyiceberg.catalog.hive import HiveCatalog

    if isinstance(catalog, (HiveCatalog, NoopCatalog, SqlCatalog)):
        return False
    return True


def does_support_dot_in_identifier(catalog: Catalog) -> bool:
    from pyiceberg.catalog.noop import NoopCatalog
    from pyiceberg.catalog.rest import RestCatalog
    from pyiceberg.catalog.sql import SqlCatalog

    if isinstance(catalog, RestCatalog):
        return property_as_bool(catalog.properties, "supports_dot_in_identifier", True)
    from pyiceberg.catalog.hive import HiveCatalog

    if isinstance(catalog, (HiveCatalog, NoopCatalog, SqlCatalog)):
        return False
    return True
