"""Run with `icebarrier run user_shares.py [--once|--follow]`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipeline import build  # noqa: E402

from icebarrier import main  # noqa: E402

job = build()["user_shares"]

if __name__ == "__main__":
    main(job)
