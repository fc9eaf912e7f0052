"""Checking a served (or written) index: a crawler that fetches every page the manifest names,
every linked file and its ``.metadata``, and checks their sha256s and that each page lists
exactly the manifest's wheels.
"""

from __future__ import annotations

import hashlib
import json
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from packaging.utils import canonicalize_name

from ci.index.layout import DEFAULT_PROJECT, MANIFEST, IndexError_, Page
from ci.runtime.log import default_log


def _fetch(location: str, rel: str) -> bytes:
    if "://" in location:
        url = urllib.parse.urljoin(location.rstrip("/") + "/", rel)
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read()
    return (Path(location) / rel).read_bytes()


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.anchors.append(dict(attrs))


def parse_anchors(page: bytes) -> list[dict[str, str | None]]:
    p = _Anchors()
    p.feed(page.decode("utf-8"))
    return p.anchors


def check_index(location: str, project: str = DEFAULT_PROJECT, log=default_log) -> int:
    """Crawl every page the manifest names (over HTTP or on disk), fetch every linked file
    and its .metadata, and check the sha256s and that each page lists exactly the manifest's
    wheels. Returns the number of files checked; raises IndexError_ on the first mismatch."""
    remote = "://" in location
    manifest = json.loads(_fetch(location, MANIFEST))
    name = canonicalize_name(project)
    hashes: dict[str, str] = {}
    checked_pages = 0
    for path, wheels in sorted(manifest["pages"].items()):
        for rel in (f"{path}/{name}/", f"links/{Page(path, ()).flat_name}.html"):
            anchors = parse_anchors(_fetch(location, rel if remote or not rel.endswith("/") else rel + "index.html"))
            checked_pages += 1
            got = sorted(urllib.parse.unquote(urllib.parse.urlsplit(a.get("href") or "").path.rsplit("/", 1)[-1])
                         for a in anchors)
            if got != sorted(wheels):
                raise IndexError_(f"{rel}: lists {got}, the manifest says {sorted(wheels)}")
            for a in anchors:
                href = a.get("href") or ""
                parts = urllib.parse.urlsplit(href)
                if not parts.fragment.startswith("sha256="):
                    raise IndexError_(f"{rel}: {href} has no #sha256= fragment")
                target = urllib.parse.urljoin(rel, parts.path)
                where = target if remote else urllib.parse.unquote(target)
                if target not in hashes:
                    hashes[target] = hashlib.sha256(_fetch(location, where)).hexdigest()
                    meta_sha = hashlib.sha256(_fetch(location, where + ".metadata")).hexdigest()
                    for attr in ("data-core-metadata", "data-dist-info-metadata"):
                        if a.get(attr) != f"sha256={meta_sha}":
                            raise IndexError_(f"{rel}: {href}: {attr} does not match the .metadata file")
                if hashes[target] != parts.fragment.removeprefix("sha256="):
                    raise IndexError_(f"{rel}: {target}: sha256 {hashes[target]}, the page says {parts.fragment}")
    log(f"checked {checked_pages} pages, {len(hashes)} files: every sha256 and .metadata matches")
    return len(hashes)
