"""MkDocs hooks of the documentation site (mkdocs.yml).

- The README is the site's home page, and the examples' walk-throughs (with their files) are
  pages beside the docs: each page stays where it is in the repository, and its links, written
  for the repository (GitHub renders them there), are rewritten to the site's pages. A link to
  anything else in the repository is left as it is, and the strict build fails on it.
- The server's OpenAPI document is written for the REST reference (``rest.md``).
- A CLI command without help text fails the build, naming it (the reference is generated from the
  commands: ``cli.md``).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
SKIP = ("data", "__pycache__")


def on_pre_build(config) -> None:
    from icebarrier.apps.catalog.server import openapi_document
    from icebarrier.cli.main import cli

    require_help(cli)
    out = REPO / "build" / "openapi.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(openapi_document(), indent=1))


def require_help(cli) -> None:
    """Every command of the ``cli`` group (and the group) has help text, else a PluginError naming
    those that have none."""
    import click

    def walk(command: click.Command, path: str) -> list[str]:
        missing = [] if (command.help or command.short_help or "").strip() else [path]
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                missing += walk(sub, f"{path} {name}")
        return missing

    missing = walk(cli, "icebarrier")
    if missing:
        raise PluginError(f"CLI commands without help text: {', '.join(missing)}; give each a docstring")


def on_files(files, config):
    files.append(File.generated(config, "index.md", abs_src_path=str(REPO / "README.md")))
    for path in sorted((REPO / "examples").rglob("*")):
        relative = path.relative_to(REPO)
        if path.is_file() and not set(relative.parts) & set(SKIP):
            files.append(File.generated(config, relative.as_posix(), abs_src_path=str(path)))
    return files


def _in_repository(src_uri: str) -> str:
    """Where a page of the site is in the repository."""
    if src_uri == "index.md":
        return "README.md"
    return src_uri if src_uri.startswith("examples/") else f"docs/{src_uri}"


def _in_site(repo_path: str) -> str | None:
    """Where a file of the repository is in the site (None: not in it)."""
    if repo_path == "README.md":
        return "index.md"
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    if repo_path.startswith("examples/"):
        return repo_path
    return None


def on_page_markdown(markdown: str, page, config, files) -> str:
    here = _in_repository(page.file.src_uri)

    def rewrite(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        site = _in_site(posixpath.normpath(posixpath.join(posixpath.dirname(here), path)))
        if site is None:
            return m.group(0)
        relative = os.path.relpath(site, posixpath.dirname(page.file.src_uri) or ".")
        return f"{m.group(1)}{relative}{'#' + anchor if anchor else ''}{m.group(3)}"

    return LINK.sub(rewrite, markdown)
