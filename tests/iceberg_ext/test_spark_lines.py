"""The Spark lines icebarrier runs on (DESIGN.md, "The engines users run today"): the installed
PySpark's line picks Iceberg's runtime jar, a configuration for another line names that line's
jar, and a line Iceberg serves no runtime for is refused in one line naming the supported ones."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

from icebarrier.cli.main import cli as command
from icebarrier.iceberg_ext import maven, spark_lines
from icebarrier.iceberg_ext.errors import SparkUnavailableError


def _jars(*args: str) -> list[str]:
    out = CliRunner().invoke(command, ["spark-conf", "--format", "json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)["spark.jars"].split(",")


@pytest.mark.parametrize("version", ["4.1", "3.5"])
def test_a_configuration_for_a_spark_line_names_that_lines_pinned_runtime(lake, version):
    """`spark-conf --spark-version` and `connect --engine spark --spark-version` give the Iceberg
    runtime of that line (its Scala version in the name), from the Maven cache, its digest checked."""
    line = spark_lines.LINES[version]
    runtime = str(maven.resolve(line.runtime))
    assert runtime.endswith(f"iceberg-spark-runtime-{version}_{line.scala}-{spark_lines.ICEBERG_VERSION}.jar")
    assert _jars("--spark-version", version)[0] == runtime
    assert _jars("--spark-version", f"{version}.9")[0] == runtime  # any release of the line
    out = CliRunner().invoke(command, ["connect", "--engine", "spark", "--spark-version", version])
    assert out.exit_code == 0 and f"spark.jars {runtime}" in out.output, out.output


@pytest.mark.other_line
def test_the_installed_pyspark_picks_its_line(lake):
    """Without --spark-version the configuration is for the PySpark installed here."""
    import pyspark

    line = spark_lines.installed()
    assert pyspark.__version__.startswith(f"{line.version}.")
    assert _jars()[0] == str(line.runtime.path_in(maven.repository()))


@pytest.mark.parametrize("version", ["4.0.1", "4.2.0", "4.3.0", "3.4.4", "2.4.8"])
def test_a_spark_line_without_an_iceberg_runtime_is_refused_naming_the_supported_ones(version):
    """A PySpark (or a --spark-version) of a line Iceberg 1.12 serves no runtime for: one line naming
    the version, each supported line and how to install it."""
    with pytest.raises(SparkUnavailableError) as refused:
        spark_lines.line_of(version)
    said = str(refused.value)
    assert f"Spark {version} has no Iceberg" in said and "\n" not in said
    for line in spark_lines.LINES.values():
        assert f"Spark {line.version} ({line.install})" in said


@pytest.mark.slow
def test_the_suites_slice_passes_on_the_other_spark_line():
    """The tests marked ``other_line`` (a root job killed at a fault point, the shopping pipeline's
    root, SQL and transform jobs, Spark reading every warehouse of the catalog on S3, the Kafka
    stream, the installed line's jars) run again on the supported line this suite does not run on,
    in its own environment (tests/other_line.py): both lines are tested by one `pytest`. Only the
    files that mark a test so are collected there (all of them took 14 CPU-s to collect)."""
    from tests import other_line

    python = other_line.python()
    line = other_line.other()
    found = subprocess.run([python, "-c", "import pyspark; print(pyspark.__version__)"], capture_output=True, text=True)
    assert found.stdout.startswith(f"{line.version}."), found.stderr
    marked = sorted(
        str(f.relative_to(other_line.REPO))
        for f in (other_line.REPO / "tests").rglob("test_*.py")
        if "mark.other_line" in f.read_text()
    )
    done = subprocess.run(
        [python, "-m", "pytest", "-m", "other_line", "-n", "0", "-p", "no:cacheprovider", "-q", "-rfE", *marked],
        capture_output=True,
        text=True,
        cwd=other_line.REPO,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    ran = [ln for ln in done.stdout.splitlines() if " passed" in ln]
    assert ran and "skipped" not in ran[-1], done.stdout[-3000:]  # every test of the slice ran, on that line
