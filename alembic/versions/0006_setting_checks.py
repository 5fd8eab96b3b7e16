"""Settings are validated where they are stored: a bad value is refused at write time, so no
client ever reads one it cannot parse (e.g. ``barrier_interval_ms = 'abc'``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


CHECK = """
ALTER TABLE setting ADD CONSTRAINT setting_known_value_check CHECK (
    CASE key
        WHEN 'barrier_interval_ms' THEN
            CASE WHEN value ~ '^[0-9]{1,9}$' THEN value::bigint BETWEEN 1 AND 604800000 ELSE false END
        ELSE false
    END)
"""


def upgrade() -> None:
    op.execute(CHECK)


def downgrade() -> None:
    op.execute("ALTER TABLE setting DROP CONSTRAINT setting_known_value_check")
