"""A Kafka broker for this example: icebarrier's pinned one (Kafka 3.9.1 from Maven Central, KRaft,
one node on 127.0.0.1), its log under data/kafka. Yours works the same: set KAFKA_BOOTSTRAP.

    python3 broker.py start              # in the background; its address goes to data/kafka/bootstrap
    python3 broker.py topic orders       # a topic stamped by the broker (LogAppendTime), 3 partitions
    python3 broker.py stop
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HOME = Path(__file__).resolve().parent / "data" / "kafka"


def start() -> None:
    from icebarrier.apps.kafka_broker import Broker

    broker = Broker(HOME)
    with open(HOME / "broker.log", "ab") as log:
        proc = subprocess.Popen(
            broker._command("kafka.Kafka", str(broker.config)), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    (HOME / "pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 60
    while not broker._answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the broker did not start; see {HOME / 'broker.log'}")
        time.sleep(0.2)
    (HOME / "bootstrap").write_text(broker.bootstrap)
    print(broker.bootstrap)


def topic(name: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": (HOME / "bootstrap").read_text()})
    new = NewTopic(name, num_partitions=3, replication_factor=1, config={"message.timestamp.type": "LogAppendTime"})
    for future in admin.create_topics([new]).values():
        future.result(30)


def stop() -> None:
    pid = int((HOME / "pid").read_text())
    os.kill(pid, signal.SIGTERM)
    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


if __name__ == "__main__":
    {"start": start, "topic": lambda: topic(sys.argv[2]), "stop": stop}[sys.argv[1]]()
