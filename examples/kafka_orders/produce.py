"""Orders into the topic: RATE a second for SECONDS, in transactions of 50; every tenth transaction
is aborted (its records reach the log; read_committed consumers never see them).

    python3 produce.py RATE SECONDS          # prints how many orders it committed
"""

import json
import os
import random
import sys
import time
from pathlib import Path

from confluent_kafka import Producer

HERE = Path(__file__).resolve().parent
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
bootstrap = os.environ.get("KAFKA_BOOTSTRAP") or (HERE / "data" / "kafka" / "bootstrap").read_text().strip()
producer = Producer(
    {"bootstrap.servers": bootstrap, "transactional.id": f"orders-{os.getpid()}", "linger.ms": 5, "log_level": 3}
)
producer.init_transactions(30)
rng, committed, n, started = random.Random(), 0, 0, time.monotonic()
next_id = int(time.time() * 1000) * 1000  # ids unique across runs
while time.monotonic() - started < seconds:
    n += 1
    producer.begin_transaction()
    for _ in range(50):
        next_id += 1
        order = {"id": next_id, "user_id": rng.randrange(20), "amount": rng.randrange(1, 100)}
        producer.produce(os.environ.get("KAFKA_TOPIC", "orders"), json.dumps(order).encode())
    if n % 10 == 0:
        producer.flush(30)
        producer.abort_transaction(30)
    else:
        producer.commit_transaction(30)
        committed += 50
    time.sleep(max(0.0, n * 50 / rate - (time.monotonic() - started)))
print(committed)
