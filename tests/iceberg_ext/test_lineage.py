"""OpenLineage run events, through openlineage-python's own file transport: the runtime (the
shopping pipeline on Spark) and `job exec` (plain scripts) emit START and COMPLETE (or FAIL)
per computed barrier; every event parses into the client's models and names the snapshots
read and written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import dataset_version_dataset

from icebarrier.control_plane import barriers, reads
from icebarrier.control_plane.model import TableName
from icebarrier.iceberg_ext.runtime import Runtime
from tests.iceberg_ext.test_job_exec import command, job_exec, setup_pipeline

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "shopping"


def file_transport(path: Path) -> dict[str, str]:
    return {
        "OPENLINEAGE__TRANSPORT__TYPE": "file",
        "OPENLINEAGE__TRANSPORT__LOG_FILE_PATH": str(path),
        "OPENLINEAGE__TRANSPORT__APPEND": "true",
    }


def parse(line: str) -> RunEvent:
    """One event as the client's model (its validators check the run id, times and URIs)."""
    d = json.loads(line)

    def versioned(cls, x):
        facets = {
            k: dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=v["datasetVersion"])
            for k, v in x.get("facets", {}).items()
            if k == "version"
        }
        return cls(namespace=x["namespace"], name=x["name"], facets=facets)

    return RunEvent(
        eventType=RunState(d["eventType"]),
        eventTime=d["eventTime"],
        producer=d["producer"],
        run=Run(runId=d["run"]["runId"]),
        job=Job(namespace=d["job"]["namespace"], name=d["job"]["name"]),
        inputs=[versioned(InputDataset, x) for x in d["inputs"]],
        outputs=[versioned(OutputDataset, x) for x in d["outputs"]],
    ), d


def events(path: Path) -> list[tuple[RunEvent, dict]]:
    return [parse(line) for line in path.read_text().splitlines() if line.strip()]


def versions(datasets) -> dict[str, str | None]:
    return {d.name: (d.facets["version"].datasetVersion if "version" in d.facets else None) for d in datasets}


def test_job_exec_emits_a_run_per_barrier_naming_the_snapshots(lake, server, tmp_path):
    creds = setup_pipeline(lake)
    log = tmp_path / "lineage.jsonl"
    b = barriers.issue(lake.conn).barrier
    for job in ("ingest", "count"):
        job_exec(server, creds[job], job, command(lake, job), env=file_transport(log))
    failed = job_exec(server, creds["summarize"], "summarize", ["false"], env=file_transport(log), expect=1)
    assert "is not published" in failed["stderr"]
    seen = events(log)
    assert [(e.job.name, e.eventType.value) for e, _ in seen] == [
        ("ingest", "START"),
        ("ingest", "COMPLETE"),
        ("count", "START"),
        ("count", "COMPLETE"),
        ("summarize", "START"),
        ("summarize", "FAIL"),
    ]
    assert len({e.run.runId for e, _ in seen}) == 3  # START and its end share the run
    at_b = reads.resolve(lake.conn, [lake.T("orders"), lake.T("by_barrier")], barrier=b).snapshots
    (_, ingest_done), (count_done, count_raw) = (seen[1], seen[3])
    assert ingest_done["outputs"][0]["facets"]["version"]["datasetVersion"] == str(at_b[lake.T("orders")])
    assert versions(count_done.inputs) == {str(lake.T("orders")): str(at_b[lake.T("orders")])}
    assert versions(count_done.outputs) == {str(lake.T("by_barrier")): str(at_b[lake.T("by_barrier")])}
    facet = count_raw["run"]["facets"]["icebarrier"]
    assert facet["barrier"] == b and facet["plan"] == "exact" and facet["sessionRun"].startswith("run-")
    assert "the command failed" in seen[5][1]["run"]["facets"]["errorMessage"]["message"]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"shop_lineage_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_runtime_emits_a_run_per_computed_barrier(lake, spark, tmp_path, monkeypatch):
    log = tmp_path / "lineage.jsonl"
    for key, value in file_transport(log).items():
        monkeypatch.setenv(key, value)
    shop, generate = _example("pipeline"), _example("generate")
    shop.create_tables(spark, lake.namespace)
    built = shop.build(lake.namespace, str(tmp_path / "input"))
    generate.write_batch(str(tmp_path / "input"), 1, orders=10)
    b = barriers.issue(lake.conn).barrier
    for name in ("ingest_shopping", "user_item_amount"):
        with Runtime(built[name], settings=lake.settings, spark=spark, conn=lake.conn, log=lambda _: None) as rt:
            rt.run()
    seen = events(log)
    ns = lake.namespace
    assert [(e.job.name, e.eventType.value) for e, _ in seen] == [
        (f"{ns}_ingest_shopping", "START"),
        (f"{ns}_ingest_shopping", "COMPLETE"),
        (f"{ns}_user_item_amount", "START"),
        (f"{ns}_user_item_amount", "COMPLETE"),
    ]
    sql_done = seen[3][0]
    tables = {TableName.parse(d.name) for d in (*sql_done.inputs, *sql_done.outputs)}
    at_b = reads.resolve(lake.conn, sorted(tables), barrier=b).snapshots
    assert versions(sql_done.inputs) == {str(t): str(at_b[t]) for t in tables if str(t) in versions(sql_done.inputs)}
    assert versions(sql_done.outputs) == {str(t): str(at_b[t]) for t in tables if str(t) in versions(sql_done.outputs)}
    assert sql_done.inputs and sql_done.outputs
    assert seen[3][1]["run"]["facets"]["icebarrier"]["barrier"] == b
