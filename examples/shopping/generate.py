"""Write a batch of input files for the shopping pipeline (atomically: write, then rename).

    python3 generate.py BATCH_NO [--orders 100] [--dir DIR]   (default: data/input beside this file)

Every item has one price (10 × (item_id + 1)), so the avg-price query's right answer is
known: any other price is a read that mixed moments.
"""

from __future__ import annotations

import argparse
import json
import os
import random

INPUT = os.environ.get("SHOP_INPUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "input"))


def price(item_id: int) -> float:
    return float(10 * (item_id + 1))


def write_batch(input_dir: str, batch_no: int, orders: int = 100, seed: int = 0) -> list[dict]:
    rng = random.Random(seed * 100_003 + batch_no)
    rows = []
    for i in range(orders):
        item = rng.randrange(10)
        rows.append(
            {
                "order_id": batch_no * 1_000_000 + i,
                "user_id": rng.randrange(20),
                "item_id": item,
                "amount": rng.randrange(1, 5),
                "price": price(item),
            }
        )
    ships = [{"order_id": r["order_id"], "carrier": rng.choice(["ups", "dhl"])} for r in rows if rng.random() < 0.7]
    for kind, data in (("shopping", rows), ("shipments", ships)):
        folder = os.path.join(input_dir, kind)
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(folder, f"batch-{batch_no:06d}.json")
        with open(final + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)
        os.replace(final + ".tmp", final)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("batch_no", type=int)
    parser.add_argument("--orders", type=int, default=100)
    parser.add_argument("--dir", default=INPUT)
    args = parser.parse_args()
    rows = write_batch(args.dir, args.batch_no, args.orders)
    print(f"batch {args.batch_no}: {len(rows)} orders under {os.path.relpath(args.dir)}")
