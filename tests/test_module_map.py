"""docs/architecture.md's module map names every module and package of ci/: each row's folder's
modules (`name`) and packages (`name/`), unless a package has a row of its own."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"


def _rows() -> dict[str, str]:
    text = DOC.read_text().split("## Module map", 1)[1]
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def _children(folder: Path) -> list[str]:
    names = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
    names += [p.name + "/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    return sorted(names)


def test_every_module_of_ci_is_in_the_map():
    rows = _rows()
    missing = []
    for path, text in rows.items():
        folder = REPO / path
        if not (path.startswith("ci/") and path.endswith("/") and folder.is_dir()):
            continue
        for name in _children(folder):
            if f"{path}{name}" in rows:
                continue  # a row of its own
            if f"`{name}`" not in text and f"`{name.rstrip('/')}`" not in text:
                missing.append(f"{path}{name}")
    assert not missing, f"docs/architecture.md's module map does not name: {missing}"


def test_every_package_of_ci_has_a_row_or_is_named():
    rows = _rows()
    packages = [p for p in (REPO / "ci").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert packages and all(f"ci/{p.name}/" in rows for p in packages), sorted(p.name for p in packages)
