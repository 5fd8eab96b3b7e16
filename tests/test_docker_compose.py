"""docker-compose.yml: what Spark drivers and executors need of it, read from the file; and
`docker compose config` parses it where the docker CLI exists."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from icebarrier.iceberg_ext import spark_lines

COMPOSE = Path(__file__).resolve().parent.parent / "docker-compose.yml"


def test_the_compose_file_gives_drivers_and_executors_what_they_need():
    """Postgres's host port is configurable; the warehouse has the same path for the driver and
    every container; the worker writes it as the user's uid and reaches the host; the Spark
    images are the default line's (what `pip install icebarrier[spark]` gives the driver), another
    line's named by one variable."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["postgres"]["ports"] == ["${ICEBARRIER_PG_PORT:-5432}:5432"]
    for name in ("spark-worker", "catalog"):
        assert "${PWD}/warehouse:${PWD}/warehouse" in services[name]["volumes"], name
    assert services["catalog"]["environment"]["ICEBARRIER_WAREHOUSE"] == "${PWD}/warehouse"
    assert services["spark-worker"]["user"] == "${ICEBARRIER_UID:-185}"
    assert "host.docker.internal:host-gateway" in services["spark-worker"]["extra_hosts"]
    line = spark_lines.DEFAULT
    for name in ("spark-master", "spark-worker"):
        variable, image = services[name]["image"].removeprefix("${").removesuffix("}").split(":-")
        assert variable == "ICEBARRIER_SPARK_IMAGE", services[name]["image"]
        assert image.split(":")[1].startswith(f"{line.version}.") and f"-scala{line.scala}-" in image, image
    assert "ICEBARRIER_SPARK_DRIVER_HOST" in COMPOSE.read_text()


def _compose() -> list[str] | None:
    """The docker compose command here, if any (the plugin, or the standalone docker-compose)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.skipif(
    _compose() is None,
    reason="no docker compose on this machine (the docker CLI here, if any, lacks the compose plugin)",
)
def test_docker_compose_config_parses_it():
    done = subprocess.run(
        [*_compose(), "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PWD": str(COMPOSE.parent)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
