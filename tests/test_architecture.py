"""The code's rooms (docs/architecture.md): the layers import downwards only (the CLI over the
apps over the Iceberg side over the control plane), no modules import each other in a circle
(counting every import: at module level, inside a function, for type checking), and no module is
past 600 lines. Read from the source (no import runs); grimp and import-linter, which do this
for a package laid out as folders of its name, do not follow ours (each folder installs as a
subpackage of ``icebarrier``)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# lowest first: a layer imports only itself and the layers before it
LAYERS = ("control_plane", "iceberg_ext", "apps", "cli")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module of the installed packages, by its dotted name."""
    found = {"icebarrier": REPO / "icebarrier" / "__init__.py"}
    for folder in LAYERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            found[".".join(["icebarrier", folder, *parts])] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports, wherever the import stands."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                levels = package.split(".")
                base = ".".join([*levels[: len(levels) - node.level + 1], *([node.module] if node.module else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


GRAPH = {name: _imports(name, path, set(_modules())) for name, path in _modules().items()}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_layers_import_downwards_only():
    upward = [
        f"{name} imports {used}"
        for name, used_all in GRAPH.items()
        for used in sorted(used_all)
        if _layer(name) is not None and _layer(used) is not None and _layer(used) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    try:
        graphlib.TopologicalSorter(GRAPH).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"an import circle: {' -> '.join(exc.args[1])}")


def test_no_module_is_past_600_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_checks_bite():
    """A circle and an upward import, made up, are found."""
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"a": {"b"}, "b": {"c"}, "c": {"a"}}).prepare()
    assert _layer("icebarrier.cli.main") > _layer("icebarrier.apps.demo") > _layer("icebarrier.control_plane.db")
    known = set(_modules())
    assert "icebarrier.control_plane.db" in _imports(
        "icebarrier.control_plane.schema", REPO / "control_plane" / "schema.py", known
    )
