"""A Spark standalone cluster on 127.0.0.1 from the pyspark install: one master and one worker,
each its own JVM (`spark-class …Master` / `…Worker`); executors run in JVMs of their own. Jobs
reach it by ``ICEBARRIER_SPARK_MASTER=spark://127.0.0.1:PORT``."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spark_class() -> tuple[Path, dict]:
    import pyspark

    home = Path(pyspark.__file__).parent
    env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}
    return home / "bin" / "spark-class", env


def _wait_for(predicate, what: str, procs: list[subprocess.Popen], log: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a cluster process exited ({p.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen in {timeout_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@contextmanager
def standalone_cluster(work_dir: Path, *, cores: int = 2, memory: str = "2g"):
    """Yield the master URL of a running one-worker cluster; stop both JVMs afterwards."""
    spark_class, env = _spark_class()
    port, ui, worker_ui = _free_port(), _free_port(), _free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
    log = work_dir / "cluster.log"
    procs: list[subprocess.Popen] = []
    with open(log, "w") as out:
        try:
            procs.append(
                subprocess.Popen(
                    [
                        str(spark_class),
                        "org.apache.spark.deploy.master.Master",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--webui-port",
                        str(ui),
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
            url = f"spark://127.0.0.1:{port}"
            _wait_for(lambda: "I have been elected leader" in log.read_text(), "the master's start", procs, log)
            procs.append(
                subprocess.Popen(
                    [
                        str(spark_class),
                        "org.apache.spark.deploy.worker.Worker",
                        url,
                        "--host",
                        "127.0.0.1",
                        "--cores",
                        str(cores),
                        "--memory",
                        memory,
                        "--webui-port",
                        str(worker_ui),
                        "--work-dir",
                        str(work_dir / "work"),
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
            _wait_for(
                lambda: "Successfully registered with master" in log.read_text(),
                "the worker's registration",
                procs,
                log,
            )
            yield url
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in reversed(procs):
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
