"""A moved table's notice names the readers it may give work.

After a wave of skips (``skip_unchanged``, 0027), a moved table is announced when a reader of it
was not skipped with it (its sinks short of the move). The notice then woke every job waiting on
that table, and each planned again, most of them to find nothing to do (docs/scale.md): readers
the same wave had just skipped past the move, whose waits still held their old progress, and
readers still short of another source (a job with two sources, one of them a root with data at
the barrier). The notice now ends with ``/`` and the readers it may give work, comma-separated:
those short of the move whose every source is past their progress. The others do not wake; they
still read the move (a wait keeps every source's mark), and the move of their last source names
them. A list that would pass pg_notify's 8,000 bytes is left off, and the notice wakes every
reader as before; so do the watermark trigger's own notices (a revision's rewind among them).

Revision ID: 0032
Revises: 0031
Create Date: 2026-11-29
"""

import importlib.util
import re
from pathlib import Path

from psycopg import sql

from alembic import context, op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None

NOTIFY_ALL = """    PERFORM pg_notify('icebarrier.' || current_schema(), 'watermark ' || t.watermark || ' ' || t.name)
    FROM managed_table t
    WHERE t.table_id = ANY(v_all)
      AND EXISTS (SELECT 1 FROM job_source s JOIN job j ON j.job_id = s.job_id AND j.active
                  WHERE s.table_id = t.table_id
                    AND NOT EXISTS (SELECT 1 FROM job_sink x JOIN managed_table o ON o.table_id = x.table_id
                                    WHERE x.job_id = j.job_id AND o.watermark >= t.watermark));
"""

NOTIFY_NAMING = """    PERFORM pg_notify('icebarrier.' || current_schema(),
                      CASE WHEN octet_length(w.notice || '/' || w.named) < 8000 THEN w.notice || '/' || w.named
                           ELSE w.notice END)
    FROM (SELECT 'watermark ' || t.watermark || ' ' || t.name AS notice, r.behind, r.named
          FROM managed_table t
          CROSS JOIN LATERAL (
              SELECT count(*) AS behind,
                     coalesce(string_agg(j.name, ',' ORDER BY j.name) FILTER (WHERE NOT EXISTS (
                         SELECT 1 FROM job_source s2 JOIN managed_table m ON m.table_id = s2.table_id
                         WHERE s2.job_id = j.job_id
                           AND (m.watermark IS NULL
                                OR m.watermark <= (SELECT max(o.watermark) FROM job_sink x
                                                   JOIN managed_table o ON o.table_id = x.table_id
                                                   WHERE x.job_id = j.job_id)))), '') AS named
              FROM job_source s JOIN job j ON j.job_id = s.job_id AND j.active
              WHERE s.table_id = t.table_id
                AND NOT EXISTS (SELECT 1 FROM job_sink x JOIN managed_table o ON o.table_id = x.table_id
                                WHERE x.job_id = j.job_id AND o.watermark >= t.watermark)) r
          WHERE t.table_id = ANY(v_all)) w
    WHERE w.behind > 0;
"""


def _skip_unchanged(*, naming: bool) -> str:
    path = Path(__file__).with_name("0027_skips_without_the_jobs.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
    text = re.search(r"CREATE FUNCTION skip_unchanged\(.*?END \$\$;", earlier.UPGRADE, re.S).group(0)
    assert text.count(NOTIFY_ALL) == 1
    if naming:
        text = text.replace(NOTIFY_ALL, NOTIFY_NAMING)
    search_path = f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION").format(search_path=search_path)


def upgrade() -> None:
    op.execute(_skip_unchanged(naming=True))


def downgrade() -> None:
    op.execute(_skip_unchanged(naming=False))
