"""The Kafka orders pipeline: a topic of orders into a consistent pipeline of three levels.

    Kafka topic orders --ingest_orders (KafkaSource)--> lake.kshop.orders
    lake.kshop.orders --user_totals (SQL)--> lake.kshop.user_totals            per user: orders, total
    user_totals --user_shares (SQL join)--> lake.kshop.user_shares     each user's share of all orders' amount

The broker is ``$KAFKA_BOOTSTRAP`` (default: the one ``broker.py start`` wrote under data/kafka), the
topic ``$KAFKA_TOPIC`` (default ``orders``), the namespace ``$KSHOP_NS`` (default ``kshop``).

    python3 pipeline.py create-tables      # the namespace and the three tables (idempotent)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from icebarrier.iceberg_ext.job import RootJob, SqlJob
from icebarrier.iceberg_ext.kafka import KafkaSource

HERE = Path(__file__).resolve().parent
ORDER = "id bigint, user_id int, amount bigint"
DDL = {
    "orders": f"{ORDER}, kafka_partition int, kafka_offset bigint, kafka_timestamp timestamp",
    "user_totals": "user_id int, orders bigint, total bigint",
    "user_shares": "user_id int, orders bigint, total bigint, percent double",
}


def bootstrap() -> str:
    return os.environ.get("KAFKA_BOOTSTRAP") or (HERE / "data" / "kafka" / "bootstrap").read_text().strip()


def tables(ns: str, catalog: str = "lake") -> dict[str, str]:
    return {t: f"{catalog}.{ns}.{t}" for t in DDL}


def create_tables(spark, ns: str, catalog: str = "lake") -> None:
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {catalog}.{ns}")
    for name, full in tables(ns, catalog).items():
        spark.sql(f"CREATE TABLE IF NOT EXISTS {full} ({DDL[name]}) USING iceberg")


def build(ns: str | None = None, catalog: str | None = None, broker: str | None = None, topic: str | None = None):
    ns = ns or os.environ.get("KSHOP_NS", "kshop")
    catalog = catalog or os.environ.get("ICEBARRIER_CATALOG", "lake")
    t = tables(ns, catalog)
    return {
        "ingest_orders": RootJob(
            name=f"{ns}_ingest_orders",
            sinks=[t["orders"]],
            source=KafkaSource(broker or bootstrap(), topic or os.environ.get("KAFKA_TOPIC", "orders"), ORDER),
        ),
        "user_totals": SqlJob(
            f"{ns}_user_totals",
            f"""INSERT INTO {t["user_totals"]}
                SELECT user_id, count(*) AS orders, sum(amount) AS total FROM {t["orders"]} GROUP BY user_id""",
        ),
        "user_shares": SqlJob(
            f"{ns}_user_shares",
            f"""INSERT INTO {t["user_shares"]}
                SELECT u.user_id, u.orders, u.total, 100.0 * u.total / a.total AS percent
                FROM {t["user_totals"]} u CROSS JOIN (SELECT sum(total) AS total FROM {t["user_totals"]}) a""",
        ),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["create-tables"])
    parser.parse_args()
    from icebarrier.iceberg_ext.config import Settings
    from icebarrier.iceberg_ext.spark import spark_session

    settings = Settings.load()
    create_tables(spark_session(settings), os.environ.get("KSHOP_NS", "kshop"), settings.catalog)
