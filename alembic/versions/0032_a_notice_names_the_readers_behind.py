"""A moved table's notice names the readers behind it.

After a wave of skips (``skip_unchanged``, 0027), a moved table is announced when a reader of it
was not skipped with it: a job with work waits for it. The notice then woke every job waiting on
that table, including the readers the same wave had just skipped past it, whose waits still held
their old progress: each planned again to find nothing to do. At 200 jobs that was 18 of the 28
plans a barrier that a notice caused (docs/scale.md). The notice now ends with ``/`` and the
readers behind (every sink short of the move), comma-separated: a waiting job not among them was
skipped with the move and does not wake. A list that would pass pg_notify's 8,000 bytes is left
off, and the notice wakes every reader as before; so do the watermark trigger's own notices.

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

NOTIFY_BEHIND = """    PERFORM pg_notify('icebarrier.' || current_schema(),
                      CASE WHEN octet_length(w.notice || '/' || w.behind) < 8000 THEN w.notice || '/' || w.behind
                           ELSE w.notice END)
    FROM (SELECT 'watermark ' || t.watermark || ' ' || t.name AS notice,
                 (SELECT string_agg(j.name, ',' ORDER BY j.name)
                  FROM job_source s JOIN job j ON j.job_id = s.job_id AND j.active
                  WHERE s.table_id = t.table_id
                    AND NOT EXISTS (SELECT 1 FROM job_sink x JOIN managed_table o ON o.table_id = x.table_id
                                    WHERE x.job_id = j.job_id AND o.watermark >= t.watermark)) AS behind
          FROM managed_table t
          WHERE t.table_id = ANY(v_all)) w
    WHERE w.behind IS NOT NULL;
"""


def _skip_unchanged(*, naming: bool) -> str:
    path = Path(__file__).with_name("0027_skips_without_the_jobs.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
    text = re.search(r"CREATE FUNCTION skip_unchanged\(.*?END \$\$;", earlier.UPGRADE, re.S).group(0)
    assert text.count(NOTIFY_ALL) == 1
    if naming:
        text = text.replace(NOTIFY_ALL, NOTIFY_BEHIND)
    search_path = f"{sql.Identifier(context.config.attributes['schema']).as_string(None)}, pg_temp"
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION").format(search_path=search_path)


def upgrade() -> None:
    op.execute(_skip_unchanged(naming=True))


def downgrade() -> None:
    op.execute(_skip_unchanged(naming=False))
