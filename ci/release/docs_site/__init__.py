"""The documentation as plain HTML pages for the Pages site, beside the pip index.

The README becomes ``docs/index.html``, ``RELEASING.md`` ``docs/releasing.html`` and each
``docs/NAME.md`` ``docs/NAME.html``. Markdown is rendered by markdown-it-py (CommonMark plus
tables); headings get the ids GitHub gives them, so one ``#fragment`` works on GitHub and on the
site. Links are checked while rendering:

1. a link to another rendered page (``install.md#checking``, ``../README.md``) points at its
   HTML page, and its fragment must name a heading of that page;
2. a link to any other file of the repository must name a file that exists; it points at that
   file on GitHub (``https://github.com/OWNER/NAME/blob/HEAD/PATH``) when the repository is
   known, and is left as plain text otherwise (a local preview);
3. anything with a scheme (``https:``) is left alone.

A broken link is a :class:`DocsError` naming the page, the link and what to change. Output
depends only on the markdown files, so the same checkout gives byte-identical pages.

    python -m ci.release.docs_site --out dist/index [--repo OWNER/NAME]   # writes dist/index/docs/
"""

from __future__ import annotations

import html
import posixpath
import re
import unicodedata
import urllib.parse
from pathlib import Path
from ci.runtime.errors import InputError

REPO = Path(__file__).resolve().parents[3]
SITE_DIR = "docs"  # where the pages go, under the index root
SPECIAL = {"README.md": "index.html", "RELEASING.md": "releasing.html"}


class DocsError(InputError, ValueError):
    pass


def sources(root: Path = REPO) -> dict[str, Path]:
    """Repository path of each rendered page -> its file: the README, RELEASING.md, docs/*.md."""
    out = {name: root / name for name in SPECIAL if (root / name).is_file()}
    for p in sorted((root / "docs").glob("*.md")):
        out[f"docs/{p.name}"] = p
    return out


def page_name(rel: str) -> str:
    """The HTML file (under docs/ of the site) a rendered markdown file becomes."""
    return SPECIAL.get(rel) or Path(rel).with_suffix(".html").name


def slug(text: str) -> str:
    """GitHub's heading id: lower case, punctuation dropped (letters, digits, ``_``, ``-`` and
    spaces kept), each space a ``-``."""
    kept = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _markdown():
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table")


def _heading_text(inline) -> str:
    return "".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline"))


def headings(tokens) -> list[str]:
    """The ids of a page's headings in order, numbered as GitHub numbers repeats (``x``, ``x-1``)."""
    seen: dict[str, int] = {}
    ids = []
    for i, t in enumerate(tokens):
        if t.type == "heading_open":
            base = slug(_heading_text(tokens[i + 1]))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.append(base if n == 0 else f"{base}-{n}")
    return ids


def _links(tokens):
    for t in tokens:
        for i, c in enumerate(t.children or []):
            if c.type == "link_open":
                yield t.children, i, c


def render_site(root: Path = REPO, repo: str | None = None) -> dict[str, bytes]:
    """Every page, as ``{"docs/NAME.html": bytes}``. ``repo`` (``OWNER/NAME``): where links to
    other repository files point (GitHub); without it they become plain text."""
    if repo is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise DocsError(f"repository {repo!r}: expected OWNER/NAME")
    md = _markdown()
    srcs = sources(root)
    parsed = {rel: md.parse(p.read_text(encoding="utf-8")) for rel, p in srcs.items()}
    ids = {rel: set(headings(toks)) for rel, toks in parsed.items()}
    nav = [(page_name(rel), _title(toks, rel)) for rel, toks in parsed.items()]
    out = {}
    for rel, toks in parsed.items():
        heading_ids = iter(headings(toks))
        for t in toks:
            if t.type == "heading_open":
                t.attrSet("id", next(heading_ids))
        for children, i, link in list(_links(toks)):
            href = _resolve(rel, str(link.attrGet("href") or ""), srcs, ids, root, repo)
            if href is None:  # a repository file, no repository to point at: keep the text
                close = next(j for j in range(i, len(children)) if children[j].type == "link_close")
                children[close].type = children[i].type = "text"
                children[close].content = children[i].content = ""
                continue
            link.attrSet("href", href)
        body = md.renderer.render(toks, md.options, {})
        out[f"{SITE_DIR}/{page_name(rel)}"] = _page(_title(toks, rel), body, nav, page_name(rel)).encode("utf-8")
    return out


def _resolve(page: str, href: str, srcs: dict[str, Path], ids: dict[str, set[str]], root: Path,
             repo: str | None) -> str | None:
    parts = urllib.parse.urlsplit(href)
    if parts.scheme or parts.netloc:
        return href
    if not parts.path:  # a fragment of this page
        if parts.fragment not in ids[page]:
            raise DocsError(f"{page}: link {href!r}: no heading of this page has that id "
                            f"(headings: {', '.join(sorted(ids[page]))})")
        return href
    target = posixpath.normpath(posixpath.join(posixpath.dirname(page), urllib.parse.unquote(parts.path)))
    if target in srcs:
        if parts.fragment and parts.fragment not in ids[target]:
            raise DocsError(f"{page}: link {href!r}: {target} has no heading with id {parts.fragment!r}; "
                            "link to one of its headings (GitHub's ids: lower case, spaces as '-')")
        return page_name(target) + (f"#{parts.fragment}" if parts.fragment else "")
    if target.startswith("../") or not (root / target).exists():
        raise DocsError(f"{page}: link {href!r}: {target} does not exist in the repository; fix the path "
                        f"(relative to {posixpath.dirname(page) or 'the repository root'})")
    if repo is None:
        return None
    kind = "tree" if (root / target).is_dir() else "blob"
    return f"https://github.com/{repo}/{kind}/HEAD/{urllib.parse.quote(target)}"


def _title(tokens, rel: str) -> str:
    for i, t in enumerate(tokens):
        if t.type == "heading_open" and t.tag == "h1":
            return _heading_text(tokens[i + 1])
    return rel


STYLE = """body{font:16px/1.5 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#1f2328}
nav{font-size:.9rem;border-bottom:1px solid #d0d7de;padding-bottom:.5rem;margin-bottom:1rem}
nav a{margin-right:.8rem}table{border-collapse:collapse;display:block;overflow-x:auto;font-size:.9rem}
th,td{border:1px solid #d0d7de;padding:.25rem .5rem;vertical-align:top}
code{background:#f6f8fa;padding:.1rem .25rem;border-radius:4px}pre{background:#f6f8fa;padding:.75rem;overflow-x:auto}
pre code{padding:0}"""


def _page(title: str, body: str, nav: list[tuple[str, str]], this: str) -> str:
    links = " ".join(f'<a href="{html.escape(name)}">{html.escape(t)}</a>' if name != this else
                     f"<strong>{html.escape(t)}</strong>" for name, t in nav)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            f'<nav><a href="../">the index (pick your wheel)</a> {links}</nav>\n{body}</body>\n</html>\n')


def for_branch(published: set[str], prefix: str = "", repo: str | None = None) -> tuple[dict[str, bytes], set[str]]:
    """The pages for a Pages branch whose index lies under ``prefix``: the files to put, and the
    published pages under its ``docs/`` that are no longer produced (to delete)."""
    files = {prefix + rel: data for rel, data in render_site(REPO, repo).items()}
    stale = {p for p in published if p.startswith(f"{prefix}{SITE_DIR}/") and p.endswith(".html") and p not in files}
    return files, stale


def write_site(out: Path, repo: str | None = None, root: Path = REPO) -> list[str]:
    """Write the pages under ``out`` (an index root); returns the paths written or rewritten."""
    written = []
    for rel, data in render_site(root, repo).items():
        dst = out / rel
        if dst.is_file() and dst.read_bytes() == data:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        written.append(rel)
    return written
