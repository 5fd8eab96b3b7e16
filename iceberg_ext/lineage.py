"""OpenLineage run events, one run per barrier a job computes (the runtime and ``job exec``).

When OpenLineage is configured — ``OPENLINEAGE_URL``, ``OPENLINEAGE_CONFIG``,
``OPENLINEAGE__TRANSPORT__*`` or an ``openlineage.yml`` in the working directory, as the
``openlineage-python`` client reads them — each computed barrier emits START and then COMPLETE
or FAIL: the job (namespace ``ICEBARRIER_LINEAGE_NAMESPACE``, default ``icebarrier``), its
inputs and outputs as datasets named ``<catalog>.<namespace>.<table>`` whose version is the
Iceberg snapshot id, and the barrier in a run facet of our own, ``icebarrier``. A skipped
barrier computes nothing and emits nothing. An event that cannot be sent is logged, never
fails the job. Without ``openlineage-python`` installed nothing is emitted.
"""

from __future__ import annotations

import logging
import os
import traceback
from datetime import UTC, datetime
from pathlib import Path

from icebarrier.control_plane.model import TableName

log = logging.getLogger(__name__)

PRODUCER = "urn:icebarrier"
FACET_SCHEMA = "urn:icebarrier:facet:run:icebarrier:1"  # documented in README.md, "Lineage"
NAMESPACE_ENV = "ICEBARRIER_LINEAGE_NAMESPACE"


def configured() -> bool:
    """Is an OpenLineage transport configured (the client's own sources of configuration)?"""
    if os.environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return False
    return (
        any(k in os.environ for k in ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG"))
        or any(k.startswith("OPENLINEAGE__TRANSPORT") for k in os.environ)
        or Path("openlineage.yml").is_file()
    )


def _facet_class():
    import attr
    from openlineage.client.facet_v2 import RunFacet

    @attr.define
    class BarrierRunFacet(RunFacet):
        """The barrier a run computed: ``plan`` exact or coalesce, ``fromBarrier`` the job's
        progress before it (the barriers after it up to ``barrier`` are covered)."""

        barrier: int
        plan: str
        fromBarrier: int | None = None  # noqa: N815 - OpenLineage facets are camelCase
        sessionRun: str | None = None  # noqa: N815 - job exec's run id

        @staticmethod
        def _get_schema() -> str:
            return FACET_SCHEMA

    return BarrierRunFacet


class Lineage:
    """Emits a job's barrier runs (see the module docstring)."""

    def __init__(self, job: str, client) -> None:
        self.job, self.client = job, client
        self.namespace = os.environ.get(NAMESPACE_ENV, "icebarrier")
        self._facet = _facet_class()
        self._runs: dict[int, str] = {}

    @classmethod
    def for_job(cls, job: str) -> Lineage | None:
        """The job's lineage, or None when OpenLineage is not configured (or not installed)."""
        if not configured():
            return None
        try:
            from openlineage.client import OpenLineageClient
        except ImportError:
            log.warning("OpenLineage is configured but openlineage-python is not installed; no lineage events")
            return None
        return cls(job, OpenLineageClient())

    def _event(
        self,
        state: str,
        barrier: int,
        *,
        plan: str,
        from_barrier: int | None,
        session_run: str | None,
        inputs: dict[TableName, int | None],
        outputs: dict[TableName, int | None],
        error: str | None = None,
    ):
        from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
        from openlineage.client.facet_v2 import dataset_version_dataset, error_message_run
        from openlineage.client.uuid import generate_new_uuid

        run_id = self._runs.setdefault(barrier, str(generate_new_uuid()))
        facets = {
            "icebarrier": self._facet(
                barrier=barrier, plan=plan, fromBarrier=from_barrier, sessionRun=session_run, producer=PRODUCER
            )
        }
        if error:
            facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
                message=error, programmingLanguage="python", producer=PRODUCER
            )

        def version(snapshot_id: int | None) -> dict:
            return (
                {}
                if snapshot_id is None
                else {
                    "version": dataset_version_dataset.DatasetVersionDatasetFacet(
                        datasetVersion=str(snapshot_id), producer=PRODUCER
                    )
                }
            )

        return RunEvent(
            eventType=getattr(RunState, state),
            eventTime=datetime.now(UTC).isoformat(),
            producer=PRODUCER,
            run=Run(runId=run_id, facets=facets),
            job=Job(namespace=self.namespace, name=self.job),
            inputs=[
                InputDataset(namespace=self.namespace, name=str(t), facets=version(s))
                for t, s in sorted(inputs.items())
            ],
            outputs=[
                OutputDataset(namespace=self.namespace, name=str(t), facets=version(s))
                for t, s in sorted(outputs.items())
            ],
        )

    def _emit(self, *args, **kwargs) -> None:
        try:
            self.client.emit(self._event(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - lineage never fails the job
            log.warning("job %s: an OpenLineage event could not be sent (%s: %s)", self.job, type(exc).__name__, exc)

    def start(
        self,
        barrier: int,
        *,
        plan: str,
        from_barrier: int | None = None,
        session_run: str | None = None,
        inputs: dict[TableName, int | None] | None = None,
    ) -> None:
        self._emit(
            "START",
            barrier,
            plan=plan,
            from_barrier=from_barrier,
            session_run=session_run,
            inputs=dict(inputs or {}),
            outputs={},
        )

    def complete(
        self,
        barrier: int,
        *,
        plan: str,
        from_barrier: int | None = None,
        session_run: str | None = None,
        inputs: dict[TableName, int | None] | None = None,
        outputs: dict[TableName, int | None] | None = None,
    ) -> None:
        self._emit(
            "COMPLETE",
            barrier,
            plan=plan,
            from_barrier=from_barrier,
            session_run=session_run,
            inputs=dict(inputs or {}),
            outputs=dict(outputs or {}),
        )
        self._runs.pop(barrier, None)

    def fail(
        self,
        barrier: int,
        *,
        plan: str,
        from_barrier: int | None = None,
        session_run: str | None = None,
        error: BaseException | str,
    ) -> None:
        message = error if isinstance(error, str) else "".join(traceback.format_exception_only(error)).strip()
        self._emit(
            "FAIL",
            barrier,
            plan=plan,
            from_barrier=from_barrier,
            session_run=session_run,
            inputs={},
            outputs={},
            error=message,
        )
        self._runs.pop(barrier, None)
