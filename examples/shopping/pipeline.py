"""The shopping pipeline (the seed's example), built with the icebarrier runtime.

    shopping_src/*.json --ingest_shopping--> shopping --+--user_item_amount (SQL)--> user_item_amount
                                                        +--user_item_price  (SQL)--> user_item_price
    shipments_src/*.json --ingest_shipments--> shipments
    shopping + shipments --shipped_orders (delta join)--> shipped_orders

Tables live in namespace ``$SHOP_NS`` (default ``shop``) of catalog ``$ICEBARRIER_CATALOG``
(default ``lake``); inputs are JSON files under ``$SHOP_INPUT`` (default: data/input beside
this file, whatever the working directory). The SQL jobs are incremental (docs/incremental.md);
``SHOP_INCREMENTAL=0`` makes them recompute in full at every barrier.

    python3 pipeline.py create-tables      # the namespace and the five tables (idempotent)
"""

from __future__ import annotations

import argparse
import os

from icebarrier.iceberg_ext.job import RootJob, SqlJob, TransformJob, append, delta_join
from icebarrier.iceberg_ext.sources import FileSource

INPUT = os.environ.get("SHOP_INPUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "input"))
SHOPPING_SCHEMA = "order_id bigint, user_id bigint, item_id bigint, amount bigint, price double"
SHIPMENT_SCHEMA = "order_id bigint, carrier string"


def tables(ns: str, catalog: str = "lake") -> dict[str, str]:
    return {
        t: f"{catalog}.{ns}.{t}"
        for t in ("shopping", "shipments", "user_item_amount", "user_item_price", "shipped_orders")
    }


DDL = {
    "shopping": SHOPPING_SCHEMA,
    "shipments": SHIPMENT_SCHEMA,
    "user_item_amount": "user_id bigint, item_id bigint, amount bigint",
    "user_item_price": "user_id bigint, item_id bigint, price double",
    "shipped_orders": "order_id bigint, user_id bigint, item_id bigint, amount bigint, price double, carrier string",
}


def create_tables(spark, ns: str, catalog: str = "lake") -> None:
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {catalog}.{ns}")
    for name, full in tables(ns, catalog).items():
        spark.sql(f"CREATE TABLE IF NOT EXISTS {full} ({DDL[name]}) USING iceberg")


def build(ns: str | None = None, input_dir: str | None = None, catalog: str | None = None) -> dict:
    ns = ns or os.environ.get("SHOP_NS", "shop")
    catalog = catalog or os.environ.get("ICEBARRIER_CATALOG", "lake")
    input_dir = input_dir or INPUT
    incremental = os.environ.get("SHOP_INCREMENTAL", "1") != "0"
    t = tables(ns, catalog)
    return {
        "ingest_shopping": RootJob(
            name=f"{ns}_ingest_shopping",
            sinks=[t["shopping"]],
            source=FileSource(os.path.join(input_dir, "shopping"), SHOPPING_SCHEMA, fmt="json", pattern="*.json"),
        ),
        "ingest_shipments": RootJob(
            name=f"{ns}_ingest_shipments",
            sinks=[t["shipments"]],
            source=FileSource(os.path.join(input_dir, "shipments"), SHIPMENT_SCHEMA, fmt="json", pattern="*.json"),
        ),
        "user_item_amount": SqlJob(
            f"{ns}_user_item_amount",
            f"""
            INSERT INTO {t["user_item_amount"]}
            SELECT user_id, item_id, sum(amount) AS amount FROM {t["shopping"]} GROUP BY user_id, item_id""",
            incremental=incremental,
        ),
        "user_item_price": SqlJob(
            f"{ns}_user_item_price",
            f"""
            INSERT INTO {t["user_item_price"]}
            SELECT user_id, item_id, sum(amount * price) AS price FROM {t["shopping"]} GROUP BY user_id, item_id""",
            incremental=incremental,
        ),
        "shipped_orders": TransformJob(
            name=f"{ns}_shipped_orders",
            sources=[t["shopping"], t["shipments"]],
            sinks=[t["shipped_orders"]],
            transform=lambda ctx: append(delta_join(ctx, t["shopping"], t["shipments"], ["order_id"])),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="The shopping example's tables.")
    parser.add_argument("command", choices=["create-tables"])
    parser.parse_args()
    from icebarrier.iceberg_ext.config import Settings
    from icebarrier.iceberg_ext.spark import spark_session

    settings = Settings.load()
    ns = os.environ.get("SHOP_NS", "shop")
    spark = spark_session(settings, app_name="shopping-create-tables")
    create_tables(spark, ns, settings.catalog)
    print(f"created {', '.join(tables(ns, settings.catalog).values())} (if missing)")


if __name__ == "__main__":
    main()
