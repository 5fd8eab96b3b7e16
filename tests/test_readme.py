"""The README's examples stay true: every shell block marked ``<!-- tested: tests/test_readme.py … -->``
runs line by line (each line must exit 0) in a scratch database and with role names of its own."""

import re
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

README = Path(__file__).resolve().parent.parent / "README.md"


def marked_blocks() -> list[str]:
    return re.findall(r"<!-- tested: tests/test_readme\.py[^>]*-->\n```sh\n(.*?)```", README.read_text(), re.S)


def test_the_readme_marks_its_marked_blocks():
    assert len(marked_blocks()) >= 1


@pytest.mark.parametrize("index", range(len(marked_blocks())))
def test_a_readme_shell_block_runs_as_written(pg_server, tmp_path, index):
    """Each line of the block, in one bash session (so exports and variables carry), exits 0;
    the database, and roles, named in it are replaced by scratch ones and dropped afterwards."""
    block = marked_blocks()[index]
    suffix = uuid.uuid4().hex[:8]
    roles = sorted(set(re.findall(r"CREATE ROLE (\w+)", block)))
    names = {"icebarrier_tour": f"icebarrier_tour_{suffix}", **{r: f"{r}_{suffix}" for r in roles}}
    for old, new in names.items():
        block = re.sub(rf"\b{old}\b", new, block)
    host = psycopg.conninfo.conninfo_to_dict(pg_server)
    at, port = host.get("host", "127.0.0.1"), host.get("port", 5432)
    block = block.replace("127.0.0.1:5432", f"{at}:{port}").replace("-h 127.0.0.1 -p 5432", f"-h {at} -p {port}")
    script = "set -e -o pipefail\n" + "\n".join(
        f"echo '$ {i}'; {line}" for i, line in enumerate(block.splitlines()) if line.strip())
    try:
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README line failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    finally:
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(names["icebarrier_tour"])))
            for role in roles:
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(names[role])))
