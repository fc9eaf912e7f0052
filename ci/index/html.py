"""The index's HTML: PEP 503 pages, flat ``--find-links`` pages and the picker page at the root,
rendered from the manifest alone (byte-identical for the same inputs).
"""

from __future__ import annotations

import html
import re
import urllib.parse
import urllib.request
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ci.index.layout import DEFAULT_PROJECT, MANIFEST, MANIFEST_FORMAT, Entry, Page, _line_key, _manifest_json, pages_for
from ci.toolchain.variant import Variant, cuda_from_tag


def _esc(s: str) -> str:
    return html.escape(s, quote=True)


def _anchor(href_to_files: str, e: Entry) -> str:
    return f'<a href="{_esc(href_to_files)}{_anchor_tail(e)}'


def _anchor_tail(e: Entry) -> str:
    """Everything of an anchor after the directory part of its href (the same on every page)."""
    rec = e.record
    attrs = [f'{_esc(urllib.parse.quote(rec.wheel))}#sha256={_esc(rec.sha256)}"']
    if rec.requires_python:
        attrs.append(f'data-requires-python="{_esc(rec.requires_python)}"')
    meta = _esc(f"sha256={e.metadata_sha256}")
    attrs.append(f'data-dist-info-metadata="{meta}" data-core-metadata="{meta}"')
    if e.yanked is not None:
        attrs.append(f'data-yanked="{_esc(e.yanked)}"')
    return f"{' '.join(attrs)}>{_esc(rec.wheel)}</a><br>"


def _html(title: str, body: list[str]) -> str:
    return (
        "<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"pypi:repository-version\" content=\"1.0\">\n"
        f"<title>{_esc(title)}</title>\n</head>\n<body>\n<h1>{_esc(title)}</h1>\n"
        + "".join(line + "\n" for line in body)
        + "</body>\n</html>\n"
    )


def _url(base: str | None, path: str) -> str:
    """The absolute URL of an index path when the base is known, else a relative one."""
    return (base.rstrip("/") + "/" + path) if base else path


def _picker_rows(pages: list[Page]) -> list[tuple[str, str, Page]]:
    rows = []
    for p in pages:
        parts = p.path.split("/")
        if len(parts) == 2 and parts[1].startswith("torch"):
            rows.append((parts[1].removeprefix("torch"), parts[0], p))
    rows.sort(key=lambda r: (tuple(-x for x in _line_key(r[0])), r[1]))
    return rows


PICKER_JS = Path(__file__).resolve().parent.parent / "picker.js"


def _stable_flag(variants) -> str:
    """Whether every wheel of a page is a stable-ABI one ("true"/"false", as the page's table
    says it): such wheels load into every newer torch too, which the picker offers for a torch
    line newer than the index's."""
    labels = list(variants)
    return "true" if labels and all(Variant.parse(v).stable for v in labels) else "false"


ASK_TORCH = 'python -c "import torch; print(torch.__version__, torch.version.cuda)"'


def _missing_section(missing: dict[str, dict[str, str]] | None) -> list[str]:
    """Per release whose build jobs did not all verify a wheel: each missing target and why (the
    release notes' list, from the same build outcomes: ci.stages.provenance.missing_targets)."""
    body = []
    for version, targets in sorted((missing or {}).items(), key=lambda kv: _version_key(kv[0]), reverse=True):
        n = len(targets)
        body.append(f'<div class="missing" data-release="{_esc(version)}">')
        body.append(f"<h2>Not in release {_esc(version)} yet ({n} target{'s' * (n != 1)})</h2>")
        body.append("<ul>")
        for target, why in sorted(targets.items()):
            why_html = re.sub(r"`([^`]*)`", r"<code>\1</code>", _esc(why))
            body.append(f'<li data-target="{_esc(target)}"><code>{_esc(target)}</code>: {why_html}</li>')
        body.append("</ul>")
        body.append("<p>Their wheels are added when the failed build jobs are re-run and the release is published "
                    "again; every other wheel of the release is here.</p>")
        body.append("</div>")
    return body


def _version_key(v: str):
    try:
        return (0, Version(v))
    except InvalidVersion:
        return (-1, v)


def _root_page(project: str, pages: list[Page], base_url: str | None,
               missing: dict[str, dict[str, str]] | None = None) -> str:
    """The picker: a table of every torch line x CUDA page, and a box where a user pastes
    their torch version to get the pip command (``picker.js``, plain JS reading the table;
    :func:`pick` is its Python twin)."""
    name = canonicalize_name(project)
    body = [
        f"<p>Which wheel? Paste what <code>{_esc(ASK_TORCH)}</code> prints (e.g. <code>2.14.1+cu130 13.0</code>):</p>",
        '<p><input id="torch-version" size="40" autocomplete="off" placeholder="2.14.1+cu130 13.0"></p>',
        '<pre id="pick-answer"></pre>',
        "<p><code>--no-deps</code> keeps pip away from your torch: it installs this package alone, whatever "
        "other indexes your pip configuration adds. A wheel that does not fit your torch refuses to import "
        "and names the page to use.</p>",
        *_missing_section(missing),
        f'<table data-project="{_esc(name)}">',
        "<tr><th>torch</th><th>torch built for CUDA</th><th>wheel variants</th><th>install</th><th>--find-links page</th></tr>",
    ]
    for line, cu, page in _picker_rows(pages):
        cuda = cuda_from_tag(cu)
        variants = sorted({r.variant for r in page.records})
        url = _url(base_url, f"{page.path}/")
        flat = _url(base_url, f"links/{page.flat_name}.html")
        stable = _stable_flag(r.variant for r in page.records)
        body.append(
            f'<tr data-line="{_esc(line)}" data-cuda="{_esc(cuda)}" data-page="{_esc(page.path)}" '
            f'data-url="{_esc(url)}" data-links="{_esc(flat)}" data-stable="{stable}">'
            f"<td>{_esc(line)}</td><td>{int(cuda.split('.')[0])}.x (wheels compiled with {_esc(cu)})</td>"
            f"<td>{_esc(', '.join(variants))}</td>"
            f"<td><code>pip install --no-deps {_esc(name)} --index-url <a href=\"{_esc(page.path)}/\">{_esc(url)}</a></code></td>"
            f"<td><a href=\"links/{_esc(page.flat_name)}.html\">{_esc(flat)}</a></td></tr>"
        )
    body.append("</table>")
    body.append(
        f"<p>Every variant on one page (browsing; pip cannot tell CUDA builds apart there): "
        f"<a href=\"simple/\">simple/</a>, <a href=\"links/all.html\">links/all.html</a>. "
        f"Machine-readable: <a href=\"{MANIFEST}\">{MANIFEST}</a>."
        # The published site has the docs beside the index (ci.release.docs_site); a local one does not.
        + (f" Documentation: <a href=\"docs/\">{_esc(_url(base_url, 'docs/'))}</a> (installing, checking the "
           "install, accuracy)." if base_url else "") + "</p>"
    )
    body.append("<script>\n" + PICKER_JS.read_text(encoding="utf-8").strip() + "\n</script>")
    return _html(f"{project} wheels", body)


def render(entries: dict[str, Entry], project: str = DEFAULT_PROJECT, base_url: str | None = None,
           missing: dict[str, dict[str, str]] | None = None) -> tuple[list[Page], dict[str, bytes]]:
    """Every generated file of the index (path relative to the root -> bytes), wheels and
    .metadata files excluded. ``missing``: release version -> {target id -> why}, named on the
    root page and kept in the manifest. Pure: depends only on its arguments."""
    name = canonicalize_name(project)
    records = [entries[k].record for k in sorted(entries)]
    pages = pages_for(records)
    tails = {w: _anchor_tail(e) for w, e in entries.items()}  # each anchor's escaping done once
    out: dict[str, str] = {}
    for page in pages:
        depth = page.path.count("/") + 1
        up = "../" * (depth + 1)  # from <page>/<project>/ to the root
        out[f"{page.path}/index.html"] = _html("Simple index", [f'<a href="{_esc(name)}/">{_esc(name)}</a><br>'])
        anchors = [f'<a href="{up}files/{tails[r.wheel]}' for r in page.records]
        out[f"{page.path}/{name}/index.html"] = _html(f"Links for {name}", anchors)
        flat = [f'<a href="../files/{tails[r.wheel]}' for r in page.records]
        out[f"links/{page.flat_name}.html"] = _html(f"{name} wheels ({page.flat_name})", flat)
    out["index.html"] = _root_page(project, pages, base_url, missing)
    manifest = {
        "format": MANIFEST_FORMAT,
        "project": name,
        "base_url": base_url.rstrip("/") + "/" if base_url else None,
        "pages": {p.path: [r.wheel for r in p.records] for p in pages},
        "wheels": {k: entries[k].to_dict() for k in sorted(entries)},
        **({"missing": missing} if missing else {}),
    }
    out[MANIFEST] = _manifest_json(manifest)
    return pages, {k: v.encode("utf-8") for k, v in sorted(out.items())}


