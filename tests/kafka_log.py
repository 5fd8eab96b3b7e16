"""Producing to the suite's Kafka broker: transactional batches, some aborted, and what a
barrier's recorded range must hold (read back read_committed, independently of the source)."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition

LOG = logging.getLogger("tests.kafka")
BROKER_TIME = {"message.timestamp.type": "LogAppendTime"}


def new_topic(broker, *, partitions: int = 2, config: dict | None = None) -> str:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=partitions, config={**BROKER_TIME, **(config or {})})
    return topic


class Orders:
    """A transactional producer of orders ``{"id", "user_id", "amount"}``; ``produced`` holds the
    ids of every committed order, ``aborted`` those of aborted transactions (flushed first, so
    their records are in the log and must be skipped)."""

    def __init__(self, broker, topic: str, *, transactional_id: str | None = None) -> None:
        self.topic = topic
        self.producer = Producer(
            {
                "bootstrap.servers": broker.bootstrap,
                "transactional.id": transactional_id or f"orders-{uuid.uuid4().hex[:8]}",
                "logger": LOG,
                "message.timeout.ms": 120_000,
                "transaction.timeout.ms": 120_000,
            }
        )
        self.producer.init_transactions(60)
        self.next_id = 0
        self.produced: list[int] = []
        self.aborted: list[int] = []
        self.uncertain: list[int] = []  # a transaction cut short by a broker restart: committed or not

    def batch(self, n: int, *, abort: bool = False, partition: int | None = None) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        try:
            self.producer.begin_transaction()
            for i in ids:
                value = json.dumps({"id": i, "user_id": i % 7, "amount": i % 13 + 1}).encode()
                if partition is None:
                    self.producer.produce(self.topic, value, key=str(i).encode())
                else:
                    self.producer.produce(self.topic, value, key=str(i).encode(), partition=partition)
            self.producer.flush(60)
            if abort:
                self.producer.abort_transaction(60)
                self.aborted += ids
            else:
                self.producer.commit_transaction(60)
                self.produced += ids
        except Exception:
            self.uncertain += ids
            try:
                self.producer.abort_transaction(30)
            except Exception:
                pass
            raise
        return ids

    def raw(self, value: bytes) -> None:
        self.producer.begin_transaction()
        self.producer.produce(self.topic, value, partition=0)
        self.producer.commit_transaction(60)


class Load(threading.Thread):
    """Orders at about ``per_s`` a second in transactions of ``size``, every tenth aborted, until stopped.
    Errors while the broker is down are retried (the transaction is aborted and sent again)."""

    def __init__(self, orders: Orders, *, per_s: float = 200, size: int = 20) -> None:
        super().__init__(daemon=True)
        self.orders, self.per_s, self.size = orders, per_s, size
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self.orders.batch(self.size, abort=n % 10 == 0)
            except Exception:  # the broker restarting: that transaction is uncertain
                self.errors += 1
                time.sleep(0.5)
                continue
            self.stop.wait(self.size / self.per_s)


def all_committed(broker, topic: str) -> list[int]:
    """Every order id committed to ``topic`` (read from the log's start to its last stable offset)."""
    from confluent_kafka import IsolationLevel
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": broker.bootstrap, "logger": LOG})
    meta = admin.list_topics(topic, timeout=30).topics[topic]
    wanted = {TopicPartition(topic, p): OffsetSpec.latest() for p in meta.partitions}
    futures = admin.list_offsets(wanted, isolation_level=IsolationLevel.READ_COMMITTED)
    return committed_in(broker, topic, {tp.partition: (0, f.result(30).offset) for tp, f in futures.items()})


def committed_in(broker, topic: str, offsets: dict[int, tuple[int, int]]) -> list[int]:
    """The order ids a read_committed consumer finds in ``offsets`` (partition -> [start, end))."""
    consumer = Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": f"check-{uuid.uuid4().hex[:6]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "logger": LOG,
        }
    )
    ids: list[int] = []
    wanted = {p: r for p, r in offsets.items() if r[1] > r[0]}
    try:
        if not wanted:
            return ids
        consumer.assign([TopicPartition(topic, p, s) for p, (s, _) in wanted.items()])
        deadline = time.monotonic() + 60
        while wanted and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            p = msg.partition()
            if p not in wanted:
                continue
            if msg.error():
                if msg.offset() >= wanted[p][1]:
                    del wanted[p]
                continue
            if msg.offset() >= wanted[p][1]:
                del wanted[p]
                continue
            ids.append(json.loads(msg.value())["id"])
        assert not wanted, f"partitions {sorted(wanted)} not read to their end"
    finally:
        consumer.close()
    return ids
