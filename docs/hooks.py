"""MkDocs hooks of the documentation site (mkdocs.yml).

- The README is the site's home page, and the examples' walk-throughs (with their files) are
  pages beside the docs: each page stays where it is in the repository, and its links, written
  for the repository (GitHub renders them there), are rewritten to the site's pages. A link to
  anything else in the repository is left as it is, and the strict build fails on it.
- The server's OpenAPI document is written for the REST reference (``rest.md``).
- A CLI command without help text fails the build, naming it (the reference is generated from the
  commands: ``cli.md``).
- The pages with a Mermaid diagram load Mermaid from the site itself, not from a CDN (Material
  fetches it from unpkg unless it is loaded already), so the diagrams render offline: the
  pinned ``mermaid.min.js``, fetched once with ``npm pack`` from the npm registry into the cache,
  its SHA-256 checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
SKIP = ("data", "__pycache__")
MERMAID = ("11.17.2", "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8")  # mermaid.min.js
MERMAID_JS = "assets/javascripts/mermaid.min.js"  # in the site


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


def mermaid_js() -> Path:
    """The pinned ``mermaid.min.js``: from the cache, else fetched with ``npm pack`` (the package's
    integrity checked by npm against the registry) and checked against its pinned SHA-256."""
    from icebarrier.iceberg_ext.config import cache_dir

    version, digest = MERMAID
    path = cache_dir("mermaid", version) / "mermaid.min.js"
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(
                ["npm", "pack", f"mermaid@{version}", "--silent", "--pack-destination", tmp],
                check=True,
                capture_output=True,
                timeout=600,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise PluginError(f"cannot fetch mermaid@{version} with npm ({exc}); install Node.js and npm") from None
        with tarfile.open(next(Path(tmp).glob("mermaid-*.tgz"))) as tgz:
            member = tgz.extractfile("package/dist/mermaid.min.js")
            data = member.read() if member else b""
    if hashlib.sha256(data).hexdigest() != digest:
        raise PluginError(f"mermaid@{version}'s mermaid.min.js does not have its pinned SHA-256 {digest}")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(path)
    return path


def on_post_page(output: str, page, config) -> str:
    if 'class="mermaid"' not in output:
        return output
    up = "../" * page.url.count("/")  # the page's folder to the site's root (directory URLs)
    return output.replace("</head>", f'<script src="{up}{MERMAID_JS}"></script></head>', 1)


def on_post_build(config) -> None:
    target = Path(config["site_dir"]) / MERMAID_JS
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(mermaid_js(), target)
