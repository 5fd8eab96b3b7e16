"""The distribution installs only `icebarrier.*`, its facade resolves, and docs link inside the repo."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import importlib.util, json, sys
sys.path = [p for p in sys.path if p not in ('', '.')]
import icebarrier
found = {name: importlib.util.find_spec(name) is not None for name in ("cli", "control_plane", "iceberg_ext", "apps")}
facade = {name: getattr(icebarrier, name).__module__ for name in icebarrier.__all__}
print(json.dumps({"top_level": found, "facade": facade, "file": icebarrier.__file__}))
"""


def test_installs_no_generic_top_level_modules_and_the_facade_resolves(tmp_path):
    """From outside the checkout, `cli`, `control_plane`, `iceberg_ext` and `apps` are not
    importable; every name in `icebarrier.__all__` is."""
    import json

    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert not any(result["top_level"].values()), result["top_level"]
    assert {"SqlJob", "RootJob", "TransformJob", "ConsistentRead", "BarrierCommit", "Settings", "Level"} <= set(
        result["facade"]
    )
    assert all(module.startswith("icebarrier.") for module in result["facade"].values())


def test_docs_link_only_to_files_in_the_repository():
    """Every relative link in README.md and docs/ names a file that exists in the repo."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{doc.name} links to {target}"
