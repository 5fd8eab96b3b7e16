"""The Spark lines icebarrier runs on (DESIGN.md, "The engines users run today"): the installed
PySpark's line picks Iceberg's runtime jar, a configuration for another line names that line's
jar, and a line Iceberg serves no runtime for is refused in one line naming the supported ones."""

from __future__ import annotations

import json

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
