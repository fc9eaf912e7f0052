"""The pip index: PEP 503 simple pages per variant plus flat ``--find-links`` pages.

Layout under the index root (``dist/index`` locally, the Pages site when published)::

    files/<wheel>                     the wheels, and <wheel>.metadata (PEP 658)
    simple/                           every variant: a PEP 503 root (index.html, sageattn3/)
    cu130/                            every wheel built for CUDA 13.x torch variants ...
    cu130/torch2.14/                  ... that loads into torch 2.14 (the page users pick)
    links/cu130.html, links/all.html  flat pages for pip --find-links

Every anchor carries ``#sha256=``, ``data-requires-python`` and PEP 658
``data-dist-info-metadata``/``data-core-metadata``. Output depends only on the records, so
the same inputs give byte-identical files.
"""

from __future__ import annotations

import html
import shutil
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from ci.record import BuildRecord, sha256_of, wheel_metadata
from ci.variant import cuda_tag


@dataclass(frozen=True)
class Page:
    """One index location: its path under the root and the records it lists."""

    path: str  # "cu130/torch2.14"
    records: tuple[BuildRecord, ...]


def torch_lines_of(rec: BuildRecord) -> list[str]:
    lines = rec.extra.get("torch_lines")
    if lines:
        return list(lines)
    return [rec.variant_value.torch]


def pages_for(records: list[BuildRecord]) -> list[Page]:
    by_path: dict[str, list[BuildRecord]] = {"simple": list(records)}
    for rec in records:
        cu = cuda_tag(rec.cuda)
        by_path.setdefault(cu, []).append(rec)
        for line in torch_lines_of(rec):
            by_path.setdefault(f"{cu}/torch{line}", []).append(rec)
    return [Page(p, tuple(sorted(rs, key=lambda r: r.wheel))) for p, rs in sorted(by_path.items())]


def _anchor(href: str, rec: BuildRecord, meta_sha: str) -> str:
    return (
        f'<a href="{html.escape(href)}#sha256={rec.sha256}" '
        f'data-requires-python="{html.escape(rec.requires_python)}" '
        f'data-dist-info-metadata="sha256={meta_sha}" data-core-metadata="sha256={meta_sha}">'
        f"{html.escape(rec.wheel)}</a><br>"
    )


def _html(title: str, body: list[str]) -> str:
    return (
        "<!DOCTYPE html>\n<html>\n<head><meta name=\"pypi:repository-version\" content=\"1.0\">"
        f"<title>{html.escape(title)}</title></head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def write_index(records: list[BuildRecord], wheels_dir: Path, out: Path, project: str = "sageattn3") -> list[Page]:
    """Write (or bring up to date) the index at ``out`` for ``records`` whose wheels lie in
    ``wheels_dir``. Idempotent: unchanged inputs rewrite nothing."""
    files = out / "files"
    files.mkdir(parents=True, exist_ok=True)
    meta_sha: dict[str, str] = {}
    for rec in records:
        src = wheels_dir / rec.wheel
        dst = files / rec.wheel
        if dst.exists() and sha256_of(dst) != rec.sha256:
            raise ValueError(
                f"{rec.wheel}: the index already holds a different file under this name "
                f"(sha256 {sha256_of(dst)[:12]}… vs {rec.sha256[:12]}…); a published wheel is never "
                f"replaced in place: bump the version, or remove it from the index first"
            )
        if not dst.exists():
            shutil.copy2(src, dst)
        meta = wheel_metadata(dst)
        meta_path = files / (rec.wheel + ".metadata")
        if not meta_path.exists() or meta_path.read_bytes() != meta:
            meta_path.write_bytes(meta)
        meta_sha[rec.wheel] = sha256_of(meta_path)
    name = canonicalize_name(project)
    pages = pages_for(records)
    for page in pages:
        depth = page.path.count("/") + 1
        up = "../" * (depth + 1)  # from <page>/<project>/ to the root
        _write(out / page.path / "index.html", _html("Simple index", [f'<a href="{name}/">{name}</a><br>']))
        anchors = [_anchor(f"{up}files/{r.wheel}", r, meta_sha[r.wheel]) for r in page.records]
        _write(out / page.path / name / "index.html", _html(f"Links for {name}", anchors))
        flat = "all" if page.path == "simple" else page.path.replace("/", "-")
        _write(out / "links" / f"{flat}.html", _html(f"{name} wheels ({flat})", [_anchor(f"../files/{r.wheel}", r, meta_sha[r.wheel]) for r in page.records]))
    return pages


def index_url(base: str, cuda: str, torch_line: str | None = None) -> str:
    """The --index-url a user with that torch passes."""
    base = base.rstrip("/")
    return f"{base}/{cuda_tag(cuda)}/" + (f"torch{torch_line}/" if torch_line else "")
