"""Root jobs from a Kafka log, exactly once (docs/kafka.md; DESIGN.md, "Streaming from a log").

Barrier B of a root job reading topic T covers, per partition, the offset range ``[start, end)``
of the records the broker stamped at or before B (system time: the topic must use
``message.timestamp.type=LogAppendTime``). ``start`` is where the previous range ended (a new
partition, or the job's first barrier: the log's start); ``end`` is the first offset stamped
after B. B may close only when every record stamped at or before B is decided: the broker's
clock is past B (with ``clock_margin_s``) and no transaction still open began at or before B
(its first record sits at the partition's last stable offset). Records of aborted transactions
never enter: ranges are read ``read_committed``.

A range is recorded in the control plane and written into the snapshot summary
(``icebarrier.kafka.offsets``) with the barrier's commit; a replay of B (after a crash, a
revision) reads exactly that range again. An empty range is a skip: no Spark work, no snapshot.

Two ways to run such a job:

- :class:`KafkaSource`, a :class:`~icebarrier.iceberg_ext.sources.Source` for a ``RootJob``
  (the runtime records the range before it writes); the records are read by a plain consumer
  (confluent-kafka);
- :func:`barrier_input` in a ``job exec`` command: the range starts where the range in the
  sink's newest snapshot summary ended, is read the same way, and is handed back with the
  snapshot properties to commit it with; the catalog records it in the control plane in the
  transaction that publishes the barrier.

Spark Structured Streaming (``spark-sql-kafka``) is the third (:mod:`.kafka_stream`): each
micro-batch's offsets (:func:`batch_offsets`) recorded and summarised the same way.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from icebarrier.control_plane import runs
from icebarrier.control_plane.model import barrier_label
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext.catalog import SUMMARY_INPUT_RANGE
from icebarrier.iceberg_ext.sources import SYSTEM_TIME, Source, SourceError

SUMMARY_TOPIC = "icebarrier.kafka.topic"
SUMMARY_OFFSETS = "icebarrier.kafka.offsets"  # "0:120-245,1:80-80": partition, start and end (exclusive)
METADATA_COLUMNS = "kafka_partition int, kafka_offset bigint, kafka_timestamp timestamp"
TIMEOUT_S = 10.0
log = logging.getLogger("icebarrier.kafka")  # librdkafka's lines too (the clients' ``logger``)
log.addHandler(logging.NullHandler())


class KafkaSourceError(SourceError):
    """A Kafka source cannot be read as configured (broker, topic, record, retention)."""


@dataclass(frozen=True, slots=True)
class Record:
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: object  # deserialized


def encode_offsets(offsets: dict[int, tuple[int, int]]) -> str:
    return ",".join(f"{p}:{s}-{e}" for p, (s, e) in sorted(offsets.items()))


def decode_offsets(text: str) -> dict[int, tuple[int, int]]:
    out = {}
    for part in filter(None, text.split(",")):
        p, span = part.split(":")
        s, e = span.split("-")
        out[int(p)] = (int(s), int(e))
    return out


def json_value(value: bytes | None):
    return None if value is None else json.loads(value)


@dataclass
class KafkaLog:
    """One topic on a Kafka cluster: its partitions, the offsets a barrier ends at, and exact reads."""

    bootstrap: str
    topic: str
    config: dict[str, str] = field(default_factory=dict)  # more librdkafka settings (security, …)
    clock_margin_s: float = 0.25  # how far the broker's clock may trail this machine's
    timeout_s: float = TIMEOUT_S
    outage_s: float = 120.0  # how long a broker that answered before may be away (a restart) before a refusal
    deserialize: Callable[[bytes | None], object] = json_value

    def __post_init__(self) -> None:
        try:
            import confluent_kafka  # noqa: F401
        except ImportError:
            raise KafkaSourceError("Kafka sources need confluent-kafka; pip install 'icebarrier[kafka]'") from None
        self._admin: Any = None
        self._checked = False
        self._answered = False
        self._consumer: Any = None  # reads ranges (read_committed)
        self._peek: Any = None  # reads an open transaction's first record (read_uncommitted)
        self._unstable: dict[tuple[int, int], int] = {}  # (partition, LSO) -> that record's timestamp (ms)

    def _conf(self, **more) -> dict:
        return {"bootstrap.servers": self.bootstrap, "logger": log, **self.config, **more}

    def admin(self):
        from confluent_kafka.admin import AdminClient

        if self._admin is None:
            self._admin = AdminClient(self._conf(**{"socket.timeout.ms": int(self.timeout_s * 1000)}))
        return self._admin

    def describe(self) -> str:
        return f"kafka:{self.bootstrap}/{self.topic}"

    def _answer(self, ask: Callable, what: str):
        """``ask()``'s answer. Before the broker first answered, a failure is refused at once (a
        wrong address); after, the broker may be restarting: asked again for ``outage_s``."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + (self.outage_s if self._answered else 0)
        while True:
            try:
                answer = ask()
                self._answered = True
                return answer
            except KafkaException as exc:
                if time.monotonic() >= deadline:
                    raise KafkaSourceError(
                        f"Kafka at {self.bootstrap} did not answer {what} in {self.timeout_s:g} s "
                        f"({exc.args[0].str()}); check the source's bootstrap servers and that the broker runs"
                    ) from None
                log.warning("Kafka at %s: %s; asking again", self.bootstrap, exc.args[0].str())
                self._admin = None
                time.sleep(1.0)

    def partitions(self) -> list[int]:
        """The topic's partitions now (a partition added while a job runs is seen here)."""
        meta = self._answer(lambda: self.admin().list_topics(self.topic, timeout=self.timeout_s), "for metadata")
        found = meta.topics.get(self.topic)
        if found is None or found.error is not None:
            raise KafkaSourceError(
                f"Kafka topic {self.topic} does not exist on {self.bootstrap}; create it "
                f"(kafka-topics.sh --create --topic {self.topic} --config message.timestamp.type=LogAppendTime) "
                f"or fix the source's topic"
            )
        if not self._checked:
            self._check_timestamps()
            self._checked = True
        return sorted(found.partitions)

    def _check_timestamps(self) -> None:
        from confluent_kafka.admin import ConfigResource

        resource = ConfigResource(ConfigResource.Type.TOPIC, self.topic)
        configs = self._answer(
            lambda: self.admin().describe_configs([resource])[resource].result(timeout=self.timeout_s),
            f"with topic {self.topic}'s configuration",
        )
        kind = configs["message.timestamp.type"].value
        if kind != "LogAppendTime":
            raise KafkaSourceError(
                f"Kafka topic {self.topic} stamps records with {kind}; system-time barriers need the broker's "
                f"timestamps: kafka-configs.sh --alter --entity-type topics --entity-name {self.topic} "
                f"--add-config message.timestamp.type=LogAppendTime"
            )

    def _offsets(self, partitions: list[int], spec, *, committed: bool, full: bool = False) -> dict:
        """Each partition's offset for ``spec`` (``full``: with its timestamp, Kafka's ListOffsetsResultInfo)."""
        from confluent_kafka import IsolationLevel, TopicPartition

        if not partitions:
            return {}
        level = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
        wanted = {TopicPartition(self.topic, p): spec for p in partitions}

        def ask():
            futures = self.admin().list_offsets(wanted, isolation_level=level, request_timeout=self.timeout_s)
            return {tp.partition: f.result(timeout=self.timeout_s) for tp, f in futures.items()}

        answers = self._answer(ask, f"with topic {self.topic}'s offsets")
        return answers if full else {p: a.offset for p, a in answers.items()}

    def stable_until_us(self) -> int:
        """The newest barrier (µs) whose records are all decided now. Per partition: before the
        newest record's broker timestamp (later records are stamped no earlier), or the clock less
        the margin, whichever is later (an idle partition follows the clock); and before the first
        record of a transaction still open (it sits at the last stable offset)."""
        from confluent_kafka.admin import OffsetSpec

        clock_ms = int((time.time() - self.clock_margin_s) * 1000)
        partitions = self.partitions()
        stable = self._offsets(partitions, OffsetSpec.latest(), committed=True)
        high = self._offsets(partitions, OffsetSpec.latest(), committed=False)
        newest = self._offsets(partitions, OffsetSpec.max_timestamp(), committed=False, full=True)
        bound_ms = None
        for p in partitions:
            partition_ms = max(clock_ms, newest[p].timestamp - 1 if newest[p].offset >= 0 else clock_ms)
            if stable[p] < high[p]:
                partition_ms = min(partition_ms, self._timestamp_at(p, stable[p]) - 1)
            bound_ms = partition_ms if bound_ms is None else min(bound_ms, partition_ms)
        return (clock_ms if bound_ms is None else bound_ms) * 1000 + 999

    def _timestamp_at(self, partition: int, offset: int) -> int:
        """The broker timestamp (ms) of the record at ``offset`` (read uncommitted: an open
        transaction's first record), remembered per partition while its offset stays."""
        key = (partition, offset)
        if key not in self._unstable:
            from confluent_kafka import Consumer, TopicPartition

            if self._peek is None:  # kept, like the reader: one connection, not one per look
                peek = {
                    "group.id": "icebarrier-peek",
                    "enable.auto.commit": False,
                    "isolation.level": "read_uncommitted",
                }
                self._peek = Consumer(self._conf(**peek))
            self._peek.assign([TopicPartition(self.topic, partition, offset)])
            try:
                deadline = time.monotonic() + self.timeout_s
                while time.monotonic() < deadline:
                    msg = self._peek.poll(0.1)
                    if msg is not None and not msg.error() and msg.partition() == partition:
                        stamped = {k: v for k, v in self._unstable.items() if k[0] != partition}
                        self._unstable = {**stamped, key: msg.timestamp()[1]}
                        break
                else:
                    return 0  # not read in time: no barrier is known to be decided
            finally:
                self._peek.unassign()
        return self._unstable[key]

    def plan(self, starts: dict[int, int], barrier: int) -> dict[int, tuple[int, int]]:
        """Barrier ``barrier``'s range per partition, starting at ``starts`` (a partition not in
        it starts at the log's start). Call it once :meth:`stable_until_us` has passed the barrier."""
        from confluent_kafka.admin import OffsetSpec

        partitions = self.partitions()
        after = self._offsets(partitions, OffsetSpec.for_timestamp(barrier // 1000 + 1), committed=False)
        stable = self._offsets(partitions, OffsetSpec.latest(), committed=True)
        new = [p for p in partitions if p not in starts]
        earliest = self._offsets(new, OffsetSpec.earliest(), committed=False) if new else {}
        ranges = {}
        for p in partitions:
            start = starts.get(p, earliest.get(p, 0))
            end = after[p] if after[p] >= 0 else stable[p]
            ranges[p] = (start, max(start, min(end, stable[p])))
        return ranges

    def read(self, ranges: dict[int, tuple[int, int]]) -> Generator[Record, None, None]:
        """Exactly the committed records of ``ranges``, in offset order per partition. A range
        that retention deleted, or a record that does not deserialize, is refused by name."""
        from confluent_kafka import KafkaError, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        wanted = {p: r for p, r in ranges.items() if r[1] > r[0]}
        if not wanted:
            return
        earliest = self._offsets(sorted(wanted), OffsetSpec.earliest(), committed=False)
        for p, (start, end) in sorted(wanted.items()):
            if start < earliest[p]:
                raise self._deleted(p, start, end, earliest[p])
        consumer = self._reader()
        try:
            consumer.assign([TopicPartition(self.topic, p, s) for p, (s, _) in wanted.items()])
            open_ = dict(wanted)
            quiet_since = time.monotonic()
            while open_:
                batch = consumer.consume(10_000, 0.02)  # what has arrived; not a wait for 10,000
                if batch:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > self.outage_s:
                    raise KafkaSourceError(
                        f"Kafka topic {self.topic}: no records came from {self.bootstrap} for "
                        f"{self.outage_s:g} s while reading partitions {sorted(open_)}; check that the broker runs"
                    )
                for msg in batch:
                    p = msg.partition()
                    if p not in open_:
                        continue
                    error = msg.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            if msg.offset() >= open_[p][1]:
                                del open_[p]
                            continue
                        if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                            low = self._offsets([p], OffsetSpec.earliest(), committed=False)[p]
                            raise self._deleted(p, *open_[p], low)
                        if error.retriable() or error.code() == KafkaError._TRANSPORT:
                            continue
                        raise KafkaSourceError(f"Kafka topic {self.topic} partition {p}: {error.str()}")
                    if msg.offset() >= open_[p][1]:
                        del open_[p]
                        continue
                    try:
                        value = self.deserialize(msg.value())
                    except Exception as exc:
                        raise KafkaSourceError(
                            f"Kafka topic {self.topic} partition {p} offset {msg.offset()}: the record does not "
                            f"deserialize ({type(exc).__name__}: {exc}); fix the producer or the source's deserializer"
                        ) from None
                    yield Record(p, msg.offset(), msg.timestamp()[1], msg.key(), value)
                    if msg.offset() + 1 >= open_[p][1]:
                        del open_[p]
        finally:
            consumer.unassign()

    def holds_records(self, ranges: dict[int, tuple[int, int]]) -> bool:
        """Whether ``ranges`` hold a committed record (reading stops at the first)."""
        records = self.read(ranges)
        try:
            return next(records, None) is not None
        finally:
            records.close()

    def _reader(self):
        """The consumer ranges are read with (one per log, kept: its connection outlives a read)."""
        from confluent_kafka import Consumer

        if self._consumer is None:
            isolation = "read_uncommitted" if faults.mutated(faults.KAFKA_UNCOMMITTED) else "read_committed"
            self._consumer = Consumer(
                self._conf(
                    **{
                        "group.id": f"icebarrier-{self.topic}",
                        "enable.auto.commit": False,
                        "isolation.level": isolation,
                        "enable.partition.eof": True,
                        "auto.offset.reset": "error",
                    }
                )
            )
        return self._consumer

    def _deleted(self, partition: int, start: int, end: int, low: int) -> KafkaSourceError:
        return KafkaSourceError(
            f"Kafka topic {self.topic} partition {partition}: offsets {start}..{end - 1} are to be read but the "
            f"log starts at {low} (retention deleted them); nothing was skipped: restore the records, or "
            f"raise the topic's retention.ms and start the job afresh"
        )

    def spec(self, offsets: dict[int, tuple[int, int]], **more) -> dict:
        """The range as the control plane records it (JSON: partitions as strings)."""
        return {
            "source": self.describe(),
            "topic": self.topic,
            "offsets": {str(p): list(r) for p, r in offsets.items()},
            **more,
        }

    def summary(self, offsets: dict[int, tuple[int, int]]) -> dict[str, str]:
        return {SUMMARY_TOPIC: self.topic, SUMMARY_OFFSETS: encode_offsets(offsets)}

    def batch_spec(self, df, previous: dict | None, batch_id: int) -> dict:
        """A micro-batch's range as the control plane records it (:func:`batch_offsets`)."""
        return self.spec(batch_offsets(df, previous), batch_id=batch_id)

    def batch_summary(self, spec: dict) -> dict[str, str]:
        """The snapshot summary properties of a micro-batch's recorded range."""
        return self.summary(offsets_of(spec))

    def close(self) -> None:
        for consumer in (self._consumer, self._peek):
            if consumer is not None:
                consumer.close()
        self._consumer = self._peek = self._admin = None


def offsets_of(spec: dict) -> dict[int, tuple[int, int]]:
    """A recorded range's offsets per partition (``{}`` for none)."""
    return {int(p): (int(s), int(e)) for p, (s, e) in spec.get("offsets", {}).items()}


def ends_of(offsets: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Where each partition's range ends: where the next range starts."""
    return {p: e for p, (_, e) in offsets.items()}


def _waiting(log_: KafkaLog, barrier: int, stable: int) -> str | None:
    if barrier <= stable:
        return None
    return f"Kafka topic {log_.topic}: records stamped up to {barrier_label(barrier)} are not all decided yet"


@dataclass
class KafkaSource(Source):
    """A root job's input: topic ``topic`` on ``bootstrap``; each record's value (JSON unless
    ``deserialize`` says otherwise) becomes a row with the columns of ``schema`` (Spark DDL),
    followed by ``kafka_partition``, ``kafka_offset`` and ``kafka_timestamp``."""

    bootstrap: str
    topic: str
    schema: str
    deserialize: Callable[[bytes | None], object] = json_value
    config: dict[str, str] = field(default_factory=dict)
    clock_margin_s: float = 0.25
    timeout_s: float = TIMEOUT_S  # how long a broker may take to answer (its first answer: then it is refused)

    strategy = SYSTEM_TIME
    recheck_s = 0.1  # a barrier's records are decided within the clock margin (or a transaction's end)

    def __post_init__(self) -> None:
        self.log = KafkaLog(
            self.bootstrap,
            self.topic,
            self.config,
            clock_margin_s=self.clock_margin_s,
            timeout_s=self.timeout_s,
            deserialize=self.deserialize,
        )
        self._columns = ddl_columns(self.schema)

    def check(self) -> None:
        self.log.partitions()  # the broker answers, the topic exists, with the broker's timestamps

    def ready_until(self) -> int | None:
        return self.log.stable_until_us()

    def waiting_for(self, barrier: int) -> str | None:
        return _waiting(self.log, barrier, self.log.stable_until_us())

    def plan(self, conn, job, barrier):
        previous = runs.last_range(conn, job, before_barrier=barrier)
        starts = ends_of(offsets_of(previous or {}))
        return self.log.spec(self.log.plan(starts, barrier))

    def is_empty(self, spec):
        return all(s >= e for s, e in offsets_of(spec).values())

    reads_arrow = True

    def rows(self, spec) -> list[dict]:
        """The range's records as rows: the value's fields of ``schema``, then the Kafka columns."""
        from datetime import UTC, datetime

        out = []
        for r in self.log.read(offsets_of(spec)):
            value = r.value if isinstance(r.value, dict) else {}
            row = {c: value.get(c) for c in self._columns}
            row.update(
                kafka_partition=r.partition,
                kafka_offset=r.offset,
                kafka_timestamp=datetime.fromtimestamp(r.timestamp_ms / 1000, UTC),
            )
            out.append(row)
        return out

    def read(self, spark, spec):
        return spark.createDataFrame([tuple(r.values()) for r in self.rows(spec)], f"{self.schema}, {METADATA_COLUMNS}")

    def read_arrow(self, spec, schema):
        import pyarrow as pa

        rows = self.rows(spec)
        try:
            return pa.Table.from_pylist(rows, schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise KafkaSourceError(
                f"Kafka topic {self.topic}: records of range {encode_offsets(offsets_of(spec))} do not fit the "
                f"sink's columns ({exc}); fix the producer, or the sink's schema"
            ) from None

    def summary(self, spec) -> dict[str, str]:
        return self.log.summary(offsets_of(spec))

    def describe(self) -> str:
        return self.log.describe()


def ddl_columns(ddl: str) -> list[str]:
    """The column names of a Spark DDL schema (``"id bigint, tags array<string>"`` -> ``["id", "tags"]``)."""
    return [c.strip().split()[0].strip("`") for c in _split_ddl(ddl)]


def _split_ddl(ddl: str) -> list[str]:
    """Top-level comma-separated fields of a DDL string (commas inside <> or () kept)."""
    fields, depth, current = [], 0, ""
    for ch in ddl:
        depth += ch in "<(" and 1 or (-1 if ch in ">)" else 0)
        if ch == "," and depth == 0:
            fields.append(current)
            current = ""
        else:
            current += ch
    return [f for f in fields + [current] if f.strip()]


# -- job exec: a command computing barrier B ------------------------------------------------------------------


@dataclass(frozen=True)
class BarrierInput:
    """What a ``job exec`` command reads for its barrier: the records and how to commit them."""

    barrier: int
    offsets: dict[int, tuple[int, int]]
    records: list[Record]
    properties: dict[str, str]  # snapshot properties for the commit of these records

    @property
    def empty(self) -> bool:
        return not self.records and all(s >= e for s, e in self.offsets.values())


def last_offsets(table, topic: str) -> dict[int, int]:
    """Where the ranges committed to ``table`` (a PyIceberg table) from ``topic`` ended: the
    newest snapshot that carries them, walking back past maintenance's rewrites."""
    from icebarrier.iceberg_ext.catalog import lineage, summary_properties

    for snapshot in lineage(table):
        props = summary_properties(snapshot)
        if props.get(SUMMARY_TOPIC) == topic and SUMMARY_OFFSETS in props:
            return ends_of(decode_offsets(props[SUMMARY_OFFSETS]))
    return {}


def barrier_input(
    kafka: KafkaLog, sink, *, barrier: int | None = None, wait_s: float = 60.0, poll_s: float = 0.1
) -> BarrierInput:
    """The input of the barrier a ``job exec`` command computes (``ICEBARRIER_BARRIER``):
    waits until its records are decided, then reads them. Commit them to ``sink`` with
    ``properties`` (nothing when ``empty``: the barrier is then a skip)."""
    barrier = int(os.environ["ICEBARRIER_BARRIER"]) if barrier is None else barrier
    deadline = time.monotonic() + wait_s
    while (stable := kafka.stable_until_us()) < barrier:
        if time.monotonic() > deadline:
            raise KafkaSourceError(_waiting(kafka, barrier, stable) + f" after {wait_s:g} s")
        time.sleep(poll_s)
    offsets = kafka.plan(last_offsets(sink, kafka.topic), barrier)
    records = list(kafka.read(offsets))
    spec = kafka.spec(offsets)
    properties = {**kafka.summary(offsets), SUMMARY_INPUT_RANGE: json.dumps(spec, separators=(",", ":"))}
    return BarrierInput(barrier, offsets, records, properties)


# -- Spark Structured Streaming's micro-batches (kafka_stream.py) -----------------------------------------------------


def batch_offsets(df, previous: dict | None = None) -> dict[int, tuple[int, int]]:
    """The offset range per partition a Kafka micro-batch holds (its first and one past its last
    record); a partition it holds nothing of, an empty range where the ``previous`` recorded
    range ended (so that a range, like the other ways', names every partition read so far)."""
    from pyspark.sql import functions as F

    rows = df.groupBy("partition").agg(F.min("offset").alias("lo"), F.max("offset").alias("hi")).collect()
    carried = {p: (e, e) for p, e in ends_of(offsets_of(previous or {})).items()}
    return carried | {r["partition"]: (r["lo"], r["hi"] + 1) for r in rows}
