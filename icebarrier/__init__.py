"""icebarrier: consistent reads across a pipeline of Apache Iceberg tables.

The public API, for job files and readers::

    from icebarrier import SqlJob, TransformJob, RootJob, ConsistentRead, Level, Settings

Names are imported on first use (PEP 562), so ``import icebarrier`` needs neither PyIceberg
nor PySpark; a name whose extra is missing fails with the ``pip install`` line to run.
The subpackages are ``icebarrier.control_plane`` (Postgres rules, psycopg only),
``icebarrier.iceberg_ext`` (Iceberg side, job definitions and the PySpark job runtime), ``icebarrier.cli``
and ``icebarrier.apps`` (demo, checker, embedded Postgres).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # jobs
    "RootJob": "icebarrier.iceberg_ext.job",
    "TransformJob": "icebarrier.iceberg_ext.job",
    "SqlJob": "icebarrier.iceberg_ext.job",
    "BarrierContext": "icebarrier.iceberg_ext.barrier_context",
    "Output": "icebarrier.iceberg_ext.barrier_context",
    "append": "icebarrier.iceberg_ext.barrier_context",
    "overwrite": "icebarrier.iceberg_ext.barrier_context",
    "merge": "icebarrier.iceberg_ext.barrier_context",
    "delta_join": "icebarrier.iceberg_ext.barrier_context",
    "foreach_batch": "icebarrier.iceberg_ext.runtime",
    "Runtime": "icebarrier.iceberg_ext.runtime",
    "main": "icebarrier.iceberg_ext.runtime",
    "FileSource": "icebarrier.iceberg_ext.sources",
    "PostgresSource": "icebarrier.iceberg_ext.sources",
    "KafkaSource": "icebarrier.iceberg_ext.kafka",
    # reads and commits
    "ConsistentRead": "icebarrier.iceberg_ext.reads",
    "BarrierCommit": "icebarrier.iceberg_ext.commits",
    # settings and values
    "Settings": "icebarrier.iceberg_ext.config",
    "Level": "icebarrier.control_plane.model",
    "TableName": "icebarrier.control_plane.model",
    "Cut": "icebarrier.control_plane.model",
    "IcebarrierError": "icebarrier.control_plane.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'icebarrier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
