"""Alembic environment for the icebarrier control plane.

Run through ``control_plane.schema.upgrade`` (used by ``icebarrier db upgrade`` and the
tests), which passes an open SQLAlchemy connection in ``config.attributes["connection"]``
and the target schema in ``config.attributes["schema"]``. Migrations are raw DDL with
unqualified names: the search_path points at the schema.
"""

from alembic import context

connection = context.config.attributes["connection"]
schema = context.config.attributes["schema"]

context.configure(
    connection=connection,
    version_table_schema=schema,
    transactional_ddl=True,
)
with context.begin_transaction():
    context.run_migrations()
