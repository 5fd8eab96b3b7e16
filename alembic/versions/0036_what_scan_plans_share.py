"""What the catalog's server processes share for scan planning (issue 69):

- ``catalog_key`` holds, by name, the secret each ``icebarrier serve`` process signs with;
  ``plan-tasks`` signs the plan ids and plan tasks of server-side scan planning, so any process
  answers what another made, after restarts too. The first server that needs a key inserts it.
- ``cancelled_plan``: the plan ids a client cancelled (a digest of each), until they expire.

Only the schema's owner (the server) reads them: no role is granted either.

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-02
"""

from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE catalog_key (name text PRIMARY KEY, secret bytea NOT NULL CHECK (length(secret) >= 32), "
        "created_at timestamptz NOT NULL DEFAULT now())"
    )
    op.execute("CREATE TABLE cancelled_plan (digest text PRIMARY KEY, expires_at timestamptz NOT NULL)")


def downgrade() -> None:
    op.execute("DROP TABLE cancelled_plan")
    op.execute("DROP TABLE catalog_key")
