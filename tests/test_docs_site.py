"""The documentation site (mkdocs.yml, docs/hooks.py; `.ci/lint` builds it strict): a page that
links to a missing page or anchor fails the build naming both, and a CLI command without help
text fails it naming the command. Built here from a copy of docs/ with the fault added."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build(tmp_path: Path, extra_page: str | None = None) -> subprocess.CompletedProcess:
    """The site built strict from a copy of the checkout's docs, README and examples (``extra_page``:
    a page added to docs/ and to the navigation)."""
    for part in ("docs", "examples"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("data", "__pycache__"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    config = (ROOT / "mkdocs.yml").read_text()
    if extra_page is not None:
        (tmp_path / "docs" / "broken.md").write_text(extra_page)
        config = config.replace("  - Home: index.md\n", "  - Home: index.md\n  - Broken: broken.md\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=tmp_path,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_site_builds_with_every_link_resolved(tmp_path):
    done = _build(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="getting-started/' in home  # the README's docs/ links, as the site's pages
    assert "icebarrier namespace create" in (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "/v1/oauth/tokens" in (tmp_path / "site" / "rest" / "index.html").read_text()
    # the diagrams render offline: Mermaid from the site itself (Material would fetch it from unpkg)
    assert '<script src="assets/javascripts/mermaid.min.js">' in home and 'class="mermaid"' in home
    served = (tmp_path / "site" / "assets" / "javascripts" / "mermaid.min.js").read_bytes()
    assert hashlib.sha256(served).hexdigest() == _hooks().MERMAID[1]


def test_a_link_to_a_missing_page_or_anchor_fails_the_build_naming_both(tmp_path):
    page = "# Broken\n\nSee [nothing](no-such-page.md) and [the model](model.md#no-such-anchor).\n"
    done = _build(tmp_path, page)
    assert done.returncode != 0
    assert "broken.md" in done.stderr and "no-such-page.md" in done.stderr, done.stderr[-3000:]
    assert "no-such-anchor" in done.stderr, done.stderr[-3000:]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_a_command_without_help_fails_the_reference_naming_it():
    hooks = _hooks()

    @click.group(help="A tool.")
    def tool() -> None: ...

    @tool.command("helped")
    def helped() -> None:
        """Says what it does."""

    @tool.command("silent")
    def silent() -> None: ...

    with pytest.raises(Exception, match="icebarrier silent"):
        hooks.require_help(tool)
    from icebarrier.cli.main import cli

    hooks.require_help(cli)  # every real command has its help
