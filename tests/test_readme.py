"""The README's examples stay true.

Every ``sh`` and ``python`` block in README.md, examples/shopping/README.md and docs/ says whether
it runs: ``<!-- tested: tests/test_readme.py … -->`` or ``<!-- not run by tests/test_readme.py: why -->``.
A file's tested shell blocks run in order in one bash session (so exports carry), each line
must exit 0; the database, roles and port they name are replaced by scratch ones. Each tested
Python block runs as a script (or, marked ``imports``, is imported) in a fresh database.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.helpers import new_database
from tests.iceberg_ext.catalog_server import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "shopping"
KAFKA_EXAMPLE = ROOT / "examples" / "kafka_orders"
DOCS = (README, EXAMPLE / "README.md", KAFKA_EXAMPLE / "README.md", *sorted((ROOT / "docs").glob("*.md")))
BLOCK = re.compile(r"(?:<!-- (tested|not run by tests/test_readme\.py)([^>]*)-->\n)?```(sh|python)\n(.*?)```", re.S)
PRICES = {float(10 * (item + 1)) for item in range(10)}  # examples/shopping/generate.py's


def blocks(doc: Path, lang: str) -> list[tuple[str | None, str, str]]:
    """(mark, the rest of the marker, code) of each ``lang`` block in ``doc``."""
    return [(m[0] or None, m[1], m[3]) for m in BLOCK.findall(doc.read_text()) if m[2] == lang]


def marked_tested(doc: Path, lang: str) -> list[tuple[str, str]]:
    return [(note, code) for mark, note, code in blocks(doc, lang) if mark == "tested"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_block_says_whether_it_runs(doc):
    unmarked = [code.splitlines()[0] for lang in ("sh", "python") for mark, _, code in blocks(doc, lang) if not mark]
    assert unmarked == [], f"{doc.name}: mark these blocks tested or not run (with why): {unmarked}"
    if doc in (README, EXAMPLE / "README.md", KAFKA_EXAMPLE / "README.md"):
        assert marked_tested(doc, "sh"), f"{doc.name} runs none of its shell blocks"
    for mark, note, _ in blocks(doc, "sh") + blocks(doc, "python"):
        assert mark == "tested" or note.strip(": "), f"{doc.name}: a block not run must say why"


def run_session(script_lines: list[str], cwd: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    """Run the lines in one bash session; return (line, its stdout) for each. Fails on the first
    line that exits non-zero, showing it and its output."""
    marker = f"@@{uuid.uuid4().hex}@@"
    script = "set -e -o pipefail\n" + "\n".join(f"echo '{marker}{i}'; {line}" for i, line in enumerate(script_lines))
    done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    parts = done.stdout.split(marker)[1:]
    outputs = [(script_lines[int(p.split("\n", 1)[0])], p.split("\n", 1)[1] if "\n" in p else "") for p in parts]
    assert done.returncode == 0, (
        f"README line failed: {outputs[-1][0] if outputs else '(before the first line)'}\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return outputs


def shell_lines(code_blocks: list[str], names: dict[str, str], pg_server: str, port: int) -> list[str]:
    """The blocks' command lines with the scratch names, the test server and a free port."""
    text = "\n".join(code_blocks)
    for old, new in names.items():
        text = re.sub(rf"\b{old}\b", new, text)
    info = psycopg.conninfo.conninfo_to_dict(pg_server)
    at, pg_port = info.get("host", "127.0.0.1"), info.get("port", 5432)
    text = text.replace("127.0.0.1:5432", f"{at}:{pg_port}").replace("-h 127.0.0.1 -p 5432", f"-h {at} -p {pg_port}")
    text = text.replace("8181", str(port))
    return [line for line in text.splitlines() if line.strip()]


def session_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ICEBARRIER_")}
    return {**env, "PGUSER": "postgres", **extra}


def drop(pg_server: str, database: str, roles=()) -> None:
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
        for role in roles:
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def run_tour(doc: Path, pg_server: str, tmp_path: Path) -> dict[str, str]:
    """``doc``'s tested shell blocks in order, in one shell, in the database its ``createdb`` line
    names and with the roles it creates, each under a scratch name (dropped afterwards): what
    each line printed."""
    code = [c for _, c in marked_tested(doc, "sh")]
    suffix = uuid.uuid4().hex[:8]
    database = re.search(r"^createdb(?: -\S+ \S+)* (\w+)", "\n".join(code), re.M)[1]
    roles = sorted(set(re.findall(r"CREATE ROLE (\w+)", "\n".join(code))))
    names = {database: f"{database}_{suffix}", **{r: f"{r}_{suffix}" for r in roles}}
    try:
        outputs = run_session(
            shell_lines(code, names, pg_server, free_port()),
            tmp_path,
            session_env(ICEBARRIER_WAREHOUSE=str(tmp_path / "warehouse")),
        )
    finally:
        drop(pg_server, names[database], [names[r] for r in roles])
    return dict(outputs)


def test_every_tested_shell_block_is_run():
    """The pages whose tested shell blocks a test below runs, and no other has any."""
    run = {README, ROOT / "docs" / "getting-started.md", EXAMPLE / "README.md", KAFKA_EXAMPLE / "README.md"}
    assert {doc for doc in DOCS if marked_tested(doc, "sh")} == run


@pytest.mark.slow
def test_the_readme_tour_runs_as_written(pg_server, tmp_path):
    """The README's five-minute tour: a pipeline registered and completed, a cut, the topology,
    and the catalog served with a configuration printed for three engines."""
    said = run_tour(README, pg_server, tmp_path)
    assert "flowchart LR" in next(out for line, out in said.items() if line.startswith("icebarrier topology "))
    cut = next(out for line, out in said.items() if line.startswith("icebarrier cut "))
    assert "lake.db.revenue_by_day" in cut, cut
    printed = [out for line, out in said.items() if line.startswith("icebarrier connect ")]
    assert len(printed) == 3 and "spark.sql.catalog." in printed[0] and "connector.name=iceberg" in printed[2]


@pytest.mark.slow
def test_the_admin_tour_runs_as_written(pg_server, tmp_path):
    """docs/getting-started.md: the admin tour and the catalog lines after it."""
    said = run_tour(ROOT / "docs" / "getting-started.md", pg_server, tmp_path)
    assert "flowchart LR" in said["icebarrier topology --format mermaid"]
    assert "ingest_orders" in said["icebarrier job list"]


def avg_prices(output: str) -> list[float]:
    """The avg_price column of the avg-price query as `icebarrier query` or the DuckDB CLI prints it."""
    rows = [re.split(r"[\s│]+", line.strip(" │")) for line in output.splitlines()]
    return [float(r[2]) for r in rows if len(r) == 3 and r[0].isdigit() and re.fullmatch(r"[\d.]+", r[2])]


def run_example(example: Path, database: str, pg_server: str, tmp_path: Path) -> list[tuple[str, str]]:
    """An example's README, every tested shell block in order, run from a copy under
    ``tmp_path/examples/`` (its git-ignored data/ left out) in a scratch database in place of
    ``database``, dropped afterwards; (line, its stdout) for each line."""
    shutil.copytree(example, tmp_path / "examples" / example.name, ignore=shutil.ignore_patterns("data", "__pycache__"))
    scratch = f"{database}_{uuid.uuid4().hex[:8]}"
    try:
        return run_session(
            shell_lines(
                [c for _, c in marked_tested(example / "README.md", "sh")], {database: scratch}, pg_server, free_port()
            ),
            tmp_path,
            session_env(),
        )
    finally:
        drop(pg_server, scratch)


@pytest.mark.slow
def test_the_shopping_example_runs_from_its_readme(pg_server, tmp_path):
    """examples/shopping/README.md, every shell block in order: the pipeline from the command line,
    the avg-price query wrong at read-uncommitted and right at read-committed, with Spark and with
    the DuckDB CLI through `icebarrier serve`; it writes nothing outside its git-ignored data/."""
    before = set(os.listdir(EXAMPLE)) - {"data", "__pycache__"}
    outputs = run_example(EXAMPLE, "icebarrier_shop", pg_server, tmp_path)
    queries = [(line, avg_prices(out)) for line, out in outputs if "avg_price.sql" in line]
    assert [len(prices) for _, prices in queries] == [10] * 6, queries
    for line, prices in queries:
        wrong = sorted(set(prices) - PRICES)
        if "read-uncommitted" in line or "latest.sql" in line:
            assert wrong, f"{line}: expected prices that mix moments, got {prices}"
        else:
            assert not wrong, f"{line}: a consistent read printed prices no item has: {wrong}"
    left = set(os.listdir(tmp_path / "examples" / "shopping")) - before
    assert left <= {"__pycache__"}, f"the walk-through left {left} outside data/ (which it removes at the end)"


@pytest.mark.slow
def test_the_kafka_example_runs_from_its_readme(pg_server, tmp_path):
    """examples/kafka_orders/README.md, every shell block in order: a broker, three jobs following
    barriers, a transactional producer with aborts; every read-committed query finds the three
    tables agreeing, and at the end the orders table holds each committed order once."""
    outputs = run_example(KAFKA_EXAMPLE, "icebarrier_kshop", pg_server, tmp_path)
    said = dict(outputs)
    committed = int(next(out for line, out in outputs if line.startswith("python3 produce.py")))
    agree = [out for line, out in outputs if "agree.sql" in line]
    assert len(agree) == 2 and all(re.search(r"\btrue\b", out, re.I) for out in agree), agree
    counts = next(out for line, out in outputs if "distinct_ids" in line)
    assert re.search(rf"\b{committed}\b\s*[│|]?\s*\b{committed}\b", counts), (committed, counts)
    assert re.search(r"orders [0-9]+:[0-9]+-[0-9]+,", said[next(k for k in said if "job ranges" in k)])
    assert not (tmp_path / "examples" / "kafka_orders" / "data").exists(), "the walk-through leaves its data/ behind"


PYTHON_BLOCKS = [(doc, i) for doc in DOCS for i in range(len(marked_tested(doc, "python")))]


@pytest.mark.slow
@pytest.mark.parametrize("doc, index", PYTHON_BLOCKS, ids=[f"{d.relative_to(ROOT)}-{i}" for d, i in PYTHON_BLOCKS])
def test_a_python_block_runs(pg_server, tmp_path, doc, index):
    """A tested Python block of the README or the docs runs as a script against a database
    `icebarrier db upgrade` prepared (or, marked ``imports``, is imported: it defines jobs and runs
    none)."""
    note, code = marked_tested(doc, "python")[index]
    (tmp_path / "snippet.py").write_text(code)
    run = (
        ["-c", "import runpy; runpy.run_path('snippet.py', run_name='readme')"] if "imports" in note else ["snippet.py"]
    )
    with new_database(pg_server, "icebarrier_snippet") as dsn:
        env = session_env(ICEBARRIER_DSN=dsn, ICEBARRIER_WAREHOUSE=str(tmp_path / "warehouse"))
        upgraded = subprocess.run(["icebarrier", "db", "upgrade"], env=env, capture_output=True, text=True)
        assert upgraded.returncode == 0, upgraded.stderr
        done = subprocess.run(
            [sys.executable, *run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
    assert done.returncode == 0, f"{doc.name} Python block {index} failed:\n{code}\n{done.stderr[-3000:]}"
