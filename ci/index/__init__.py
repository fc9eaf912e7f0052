"""The pip index: PEP 503 simple pages per variant, an all-variants page, flat ``--find-links``
pages, PEP 658 metadata files, a human table at the root, and a manifest for tools.

Layout under the index root (``dist/index`` locally, the GitHub Pages site when published)::

    index.html                        the picker: one row per torch line x CUDA, with its URL
    index.json                        the manifest: every wheel's record (the merge source)
    files/<wheel>                     the wheels ...
    files/<wheel>.metadata            ... and their METADATA files (PEP 658)
    <cu>/torch<X.Y>/                  PEP 503 root for users of torch X.Y built for CUDA <cu>'s
    <cu>/torch<X.Y>/sageattn3/          major: the page users pass as --index-url
    <cu>/ , <cu>/sageattn3/           every wheel compiled with that CUDA (all torch lines)
    simple/ , simple/sageattn3/       every wheel of every variant (the all-variants page)
    links/<cu>-torch<X.Y>.html        the same sets as flat pages for pip --find-links
    links/<cu>.html, links/all.html

Every anchor carries ``#sha256=``, ``data-requires-python`` and PEP 658
``data-dist-info-metadata``/``data-core-metadata`` (the sha256 of the ``.metadata`` file);
hrefs are relative (the tree works under any base URL) and percent-encoded, text and
attributes HTML-escaped. Output depends only on the manifest, so the same inputs give
byte-identical files.

Merging: the manifest (``index.json``) holds every wheel the index ever received. Writing new
records adds to it; earlier versions stay unless ``remove`` names them. A record whose wheel
name is already indexed with another sha256 is refused: a published file is never replaced
in place.

One module per concern: ci.index.layout (the entries, pages and URLs), ci.index.html (the pages
rendered), ci.index.write (the manifest merged and the tree written), ci.index.picker (which
page serves a torch), ci.index.check (the crawler), ci.index.__main__ (``python -m ci.index``).
The names below are the index's interface to the rest of the factory (publishing, the release,
the upstream check, the tests): they use ``ci.index`` as one thing and need not know which room
holds what; the rooms import each other directly, never through this file.
"""

from ci.index.check import check_index, parse_anchors
from ci.index.html import render
from ci.index.layout import DEFAULT_PROJECT, MANIFEST, Entry, IndexError_, Page, index_url, pages_for
from ci.index.picker import pick, picker_rows
from ci.index.write import (
    IndexResult,
    check_manifest,
    load_manifest,
    manifest_entries,
    site_files,
    update_index,
    write_index,
)

__all__ = ["DEFAULT_PROJECT", "MANIFEST", "Entry", "IndexError_", "IndexResult", "Page", "check_index", "check_manifest",
           "index_url", "load_manifest", "main", "manifest_entries", "pages_for", "parse_anchors", "pick",
           "picker_rows", "render", "site_files", "update_index", "write_index"]


def main(argv: list[str] | None = None) -> int:
    """``python -m ci.index`` (ci.index.__main__)."""
    from ci.index.__main__ import main as cli

    return cli(argv)
