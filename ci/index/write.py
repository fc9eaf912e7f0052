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
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import html
import io
import json
import os
import re
import sys
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from html.parser import HTMLParser
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from ci.record import BuildRecord, RecordError, check_wheel, load_records, record_from_dict, sha256_of, wheel_metadata
from ci.variant import Variant, cuda_from_tag, cuda_tag

MANIFEST = "index.json"
MANIFEST_FORMAT = 1
DEFAULT_PROJECT = "sageattn3"


class IndexError_(ValueError):
    """The index cannot be written as asked (the message says what to change)."""


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _short(v: object) -> str:
    s = json.dumps(v) if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__
    return s if len(s) <= 40 else s[:37] + "..."


@dataclass(frozen=True)
class Entry:
    """One wheel in the index: its build record plus what the index derived from the file."""

    record: BuildRecord
    metadata_sha256: str
    yanked: str | None = None  # reason; None when not yanked

    @property
    def wheel(self) -> str:
        return self.record.wheel

    def to_dict(self) -> dict:
        d = dict(self.record.__dict__)  # what BuildRecord.to_json writes, without its round trip
        d["archs"], d["patches"] = list(d["archs"]), list(d["patches"])
        d["metadata_sha256"] = self.metadata_sha256
        if self.yanked is not None:
            d["yanked"] = self.yanked
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = MANIFEST) -> "Entry":
        """An entry of a manifest, every field checked: IndexError_ naming ``where`` (the
        manifest and the wheel) and the field."""
        try:
            rec = record_from_dict(d, where)
        except RecordError as e:
            raise IndexError_(str(e)) from None
        meta = d.get("metadata_sha256")
        if not isinstance(meta, str) or not _SHA256.fullmatch(meta):
            raise IndexError_(f"{where}: field metadata_sha256: {_short(meta)}, expected a sha256 (64 hex digits)")
        yanked = d.get("yanked")
        if yanked is not None and not isinstance(yanked, str):
            raise IndexError_(f"{where}: field yanked: {type(yanked).__name__}, expected a reason (str)")
        return cls(rec, meta, yanked)


@dataclass(frozen=True)
class Page:
    """One index location: its path under the root and the records it lists."""

    path: str  # "cu130/torch2.14"
    records: tuple[BuildRecord, ...]

    @property
    def flat_name(self) -> str:
        return "all" if self.path == "simple" else self.path.replace("/", "-")


@dataclass
class IndexResult:
    pages: list[Page]
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # files (re)written, relative to the root
    deleted: list[str] = field(default_factory=list)


def torch_lines_of(rec: BuildRecord) -> list[str]:
    lines = rec.extra.get("torch_lines") if isinstance(rec.extra, dict) else None
    if lines:
        return list(lines)
    return [rec.variant_value.torch]


def _line_key(line: str) -> tuple[int, ...]:
    return tuple(int(x) for x in line.split("."))


def pages_for(records: list[BuildRecord]) -> list[Page]:
    by_path: dict[str, list[BuildRecord]] = {"simple": list(records)}
    for rec in records:
        cu = cuda_tag(rec.cuda)
        by_path.setdefault(cu, []).append(rec)
        for line in torch_lines_of(rec):
            by_path.setdefault(f"{cu}/torch{line}", []).append(rec)
    return [Page(p, tuple(sorted(rs, key=lambda r: r.wheel))) for p, rs in sorted(by_path.items())]


# -- rendering ----------------------------------------------------------------------------

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


PICKER_JS = Path(__file__).with_name("picker.js")


def _stable_flag(variants) -> str:
    """Whether every wheel of a page is a stable-ABI one ("true"/"false", as the page's table
    says it): such wheels load into every newer torch too, which the picker offers for a torch
    line newer than the index's."""
    labels = list(variants)
    return "true" if labels and all(Variant.parse(v).stable for v in labels) else "false"


ASK_TORCH = 'python -c "import torch; print(torch.__version__, torch.version.cuda)"'


def _root_page(project: str, pages: list[Page], base_url: str | None) -> str:
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
        f"Machine-readable: <a href=\"{MANIFEST}\">{MANIFEST}</a>.</p>"
    )
    body.append("<script>\n" + PICKER_JS.read_text(encoding="utf-8").strip() + "\n</script>")
    return _html(f"{project} wheels", body)


def render(entries: dict[str, Entry], project: str = DEFAULT_PROJECT,
           base_url: str | None = None) -> tuple[list[Page], dict[str, bytes]]:
    """Every generated file of the index (path relative to the root -> bytes), wheels and
    .metadata files excluded. Pure: depends only on its arguments."""
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
    out["index.html"] = _root_page(project, pages, base_url)
    manifest = {
        "format": MANIFEST_FORMAT,
        "project": name,
        "base_url": base_url.rstrip("/") + "/" if base_url else None,
        "pages": {p.path: [r.wheel for r in p.records] for p in pages},
        "wheels": {k: entries[k].to_dict() for k in sorted(entries)},
    }
    out[MANIFEST] = _manifest_json(manifest)
    return pages, {k: v.encode("utf-8") for k, v in sorted(out.items())}


def _manifest_json(manifest: dict) -> str:
    """Sorted JSON, one wheel per line (diffable), through the C encoder (fast at 5,000 wheels)."""
    dump = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    head = {k: v for k, v in manifest.items() if k != "wheels"}
    lines = [f"{dump(k)}:{dump(v)}" for k, v in sorted(head.items())]
    wheels = ",\n".join(f" {dump(k)}:{dump(v)}" for k, v in manifest["wheels"].items())
    return "{\n" + ",\n".join(lines) + ',\n"wheels":{\n' + wheels + "\n}}\n"


# -- writing ------------------------------------------------------------------------------

def _write_bytes(path: Path, data: bytes) -> bool:
    """Write only when different; bytes, so no newline translation on any OS."""
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def load_manifest(out: Path) -> dict:
    """The manifest of the index at ``out`` ({} when there is none), its layout checked (the
    wheels' entries are checked as they are read: :func:`manifest_entries`)."""
    p = Path(out) / MANIFEST
    if not p.exists():
        return {}
    try:
        d = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexError_(f"{p}: not a readable index manifest ({e}); restore it (the published index.json), "
                          "or write the index into an empty --out") from None
    return check_manifest(d, str(p))


def check_manifest(d: object, where: str) -> dict:
    """A parsed manifest's layout (format, wheels, pages, base_url), or IndexError_ naming
    ``where`` and the field."""
    if not isinstance(d, dict):
        raise IndexError_(f"{where}: an index manifest is a JSON object, this is {type(d).__name__}")
    if d.get("format") != MANIFEST_FORMAT:
        raise IndexError_(f"{where}: manifest format {d.get('format')!r}, this factory writes {MANIFEST_FORMAT}")
    if not isinstance(d.get("wheels", {}), dict):
        raise IndexError_(f"{where}: field wheels: {_short(d['wheels'])}, expected an object (wheel name -> record)")
    pages = d.get("pages", {})
    if not isinstance(pages, dict) or not all(isinstance(v, list) for v in pages.values()):
        raise IndexError_(f"{where}: field pages: expected an object (page path -> list of wheel names)")
    if d.get("base_url") is not None and not isinstance(d["base_url"], str):
        raise IndexError_(f"{where}: field base_url: {_short(d['base_url'])}, expected a URL (str) or null")
    return d


def manifest_entries(manifest: dict, where: str) -> dict[str, Entry]:
    """The wheels of a (layout-checked) manifest, each entry checked: IndexError_ naming
    ``where``, the wheel and the field."""
    out = {}
    for name, d in manifest.get("wheels", {}).items():
        e = Entry.from_dict(d, f"{where}: wheels.{name}")
        if e.wheel != name:
            raise IndexError_(f"{where}: wheels.{name}: field wheel: {_short(e.wheel)}, expected the entry's name")
        out[name] = e
    return out


def _metadata_of(fileobj, wheel: str) -> bytes:
    """The wheel's ``<name>-<version>.dist-info/METADATA`` (what PEP 658 serves)."""
    with zipfile.ZipFile(fileobj) as z:
        for n in z.namelist():
            if n.endswith(".dist-info/METADATA") and n.count("/") == 1:
                return z.read(n)
    raise IndexError_(f"{wheel}: no .dist-info/METADATA")


def _metadata_requires_python(meta: bytes) -> str:
    return BytesHeaderParser().parsebytes(meta).get("Requires-Python", "") or ""


def _matches_removal(wheel: str, spec: str) -> bool:
    """A removal spec is a wheel file name, or a version (``1.0.0`` removes every variant of
    1.0.0; ``1.0.0+cu128.torch2.8`` only that one)."""
    if spec == wheel:
        return True
    try:
        _, version, _, _ = parse_wheel_filename(wheel)
        want = Version(spec)
    except Exception:
        return False
    if want.local is None:
        return version.public == want.public
    return version == want


def write_index(records: list[BuildRecord], wheels_dir: Path, out: Path, project: str = DEFAULT_PROJECT,
                *, base_url: str | None = None, remove: tuple[str, ...] | list[str] = (),
                yank: dict[str, str] | None = None) -> list[Page]:
    """Merge ``records`` (wheels in ``wheels_dir``) into the index at ``out`` and bring every
    page up to date. Returns the pages. See :func:`update_index` for the details."""
    return update_index(records, wheels_dir, out, project, base_url=base_url, remove=remove, yank=yank).pages


def update_index(records: list[BuildRecord], wheels_dir: Path, out: Path, project: str = DEFAULT_PROJECT,
                 *, base_url: str | None = None, remove: tuple[str, ...] | list[str] = (),
                 yank: dict[str, str] | None = None) -> IndexResult:
    """Merge and write. Earlier wheels stay unless a ``remove`` spec names them (file name or
    version); ``yank`` maps a wheel name to a reason (PEP 592). A wheel name already indexed
    with another sha256 is refused. Idempotent: unchanged inputs rewrite nothing. When
    ``base_url`` is None the one remembered in the manifest is kept."""
    wheels_dir, out = Path(wheels_dir), Path(out)
    files = out / "files"
    old = load_manifest(out)
    if base_url is None:
        base_url = old.get("base_url")
    entries = manifest_entries(old, str(out / MANIFEST))
    old_pages = set(old.get("pages", {}))
    result = IndexResult(pages=[])

    for spec in remove:
        hits = [w for w in entries if _matches_removal(w, spec)]
        if not hits:
            raise IndexError_(f"--remove {spec!r}: no indexed wheel has that name or version")
        for w in hits:
            del entries[w]
            result.removed.append(w)

    # Every record is checked before anything is written: a refusal leaves the index as it was.
    to_add: list[BuildRecord] = []
    for rec in sorted(records, key=lambda r: r.wheel):
        if not rec.wheel or not rec.sha256:
            raise IndexError_(f"a record without wheel/sha256 ({rec.target or rec.variant}); records beside wheels have both")
        if rec.wheel in result.removed:
            raise IndexError_(f"{rec.wheel}: asked both to add and to remove it")
        dst = files / rec.wheel
        have = entries.get(rec.wheel)
        if have is not None and have.record.sha256 != rec.sha256:
            raise IndexError_(
                f"{rec.wheel}: the index already holds a different file under this name "
                f"(sha256 {have.record.sha256[:12]}… vs {rec.sha256[:12]}…); a published wheel is never "
                f"replaced in place: bump the version, or remove it from the index first (--remove {rec.wheel})"
            )
        if have is not None and dst.exists():
            if have.record != rec:  # same bytes, another record: it must agree with the file as any new one
                try:
                    check_wheel(dst, rec, project)
                except RecordError as e:
                    raise IndexError_(str(e)) from None
                entries[rec.wheel] = Entry(rec, have.metadata_sha256, have.yanked)
            continue  # already indexed (checked then), same bytes: nothing to read
        if dst.exists() and sha256_of(dst) != rec.sha256:
            raise IndexError_(
                f"{rec.wheel}: {dst} holds a different file under this name; a published wheel is never "
                f"replaced in place: bump the version, or delete that file"
            )
        src = dst if dst.exists() else wheels_dir / rec.wheel
        if not src.is_file():
            raise IndexError_(f"{rec.wheel}: not in {wheels_dir}")
        try:
            check_wheel(src, rec, project)  # name, METADATA, WHEEL tags, inner record vs this record
        except RecordError as e:
            raise IndexError_(str(e)) from None
        to_add.append(rec)
    for w in yank or {}:
        if w not in entries and w not in {r.wheel for r in to_add}:
            raise IndexError_(f"--yank {w!r}: not an indexed wheel")

    for rec in to_add:
        dst = files / rec.wheel
        have = entries.get(rec.wheel)
        if not dst.exists():
            src = wheels_dir / rec.wheel
            data = src.read_bytes()  # read once: hashed, copied and searched for METADATA
            if hashlib.sha256(data).hexdigest() != rec.sha256:  # changed since it was checked
                raise IndexError_(f"{rec.wheel}: its record's sha256 does not match {src}; rebuild it")
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
            result.written.append(f"files/{rec.wheel}")
            meta = _metadata_of(io.BytesIO(data), rec.wheel)
        else:
            meta = wheel_metadata(dst)
        if _write_bytes(files / (rec.wheel + ".metadata"), meta):
            result.written.append(f"files/{rec.wheel}.metadata")
        entries[rec.wheel] = Entry(rec, hashlib.sha256(meta).hexdigest(), have.yanked if have else None)
        if have is None:
            result.added.append(rec.wheel)

    for w, reason in (yank or {}).items():
        entries[w] = Entry(entries[w].record, entries[w].metadata_sha256, reason or "")

    present = set(os.listdir(files)) if files.is_dir() else set()
    missing = [w for w in entries if w not in present or w + ".metadata" not in present]
    if missing:
        raise IndexError_(
            f"{out}: the manifest lists wheels whose files are gone: {', '.join(sorted(missing)[:5])}"
            f"{' …' if len(missing) > 5 else ''}; restore them or --remove them"
        )

    pages, generated = render(entries, project, base_url)
    for rel, data in generated.items():
        if _write_bytes(out / rel, data):
            result.written.append(rel)
    # Pages no longer produced (after a removal) and the files of removed wheels go.
    name = canonicalize_name(project)
    new_paths = {p.path for p in pages}
    for path in sorted(old_pages - new_paths, reverse=True):  # deepest first, so dirs empty
        for rel in (f"{path}/{name}/index.html", f"{path}/index.html", f"links/{Page(path, ()).flat_name}.html"):
            if (out / rel).exists():
                (out / rel).unlink()
                result.deleted.append(rel)
        for d in (out / path / name, out / path):
            try:
                d.rmdir()
            except OSError:
                pass
    for w in result.removed:
        for rel in (f"files/{w}", f"files/{w}.metadata"):
            if (out / rel).exists():
                (out / rel).unlink()
                result.deleted.append(rel)
    result.pages = pages
    return result


def site_files(local_dir: Path, remote_manifest: dict | None, project: str = DEFAULT_PROJECT,
               base_url: str | None = None, remove: tuple[str, ...] | list[str] = ()
               ) -> tuple[dict[str, bytes | Path], set[str], list[str]]:
    """Merge a locally built index into one already published (its manifest), for a host
    whose other files stay as they are (the Pages branch). Returns the files to put
    (generated pages as bytes, this index's wheels and .metadata files as paths), the paths
    to delete (pages no longer produced, removed wheels) and the wheels added. Refuses a
    wheel name published with another sha256."""
    local = load_manifest(local_dir)
    if not local:
        raise IndexError_(f"{local_dir}: no {MANIFEST}; build the index first (python -m ci.index --out {local_dir})")
    remote = check_manifest(remote_manifest, f"the published {MANIFEST}") if remote_manifest else {}
    entries = manifest_entries(remote, f"the published {MANIFEST}")
    old_generated = set(render(entries, project, remote.get("base_url"))[1]) if entries else set()
    added = []
    for name, e in sorted(manifest_entries(local, str(Path(local_dir) / MANIFEST)).items()):
        have = entries.get(name)
        if have is not None and have.record.sha256 != e.record.sha256:
            raise IndexError_(f"{name}: the published index holds a different file under this name "
                              f"(sha256 {have.record.sha256[:12]}… vs {e.record.sha256[:12]}…); bump the version "
                              f"or --remove it first")
        if have is None:
            added.append(name)
        entries[name] = e if have is None or have.yanked == e.yanked or e.yanked is not None else have
    removed = []
    for spec in remove:
        hits = [w for w in entries if _matches_removal(w, spec)]
        if not hits:
            raise IndexError_(f"--remove {spec!r}: no published wheel has that name or version")
        for w in hits:
            del entries[w]
            removed.append(w)
    base = base_url or local.get("base_url") or remote.get("base_url")
    _, generated = render(entries, project, base)
    files: dict[str, bytes | Path] = dict(generated)
    for name in local.get("wheels", {}):
        if name in entries:
            files[f"files/{name}"] = Path(local_dir) / "files" / name
            files[f"files/{name}.metadata"] = Path(local_dir) / "files" / (name + ".metadata")
    deletions = (old_generated - set(generated)) | {f"files/{w}{x}" for w in removed for x in ("", ".metadata")}
    return files, deletions, added


def index_url(base: str, cuda: str, torch_line: str | None = None) -> str:
    """The --index-url a user with that torch passes."""
    base = base.rstrip("/")
    return f"{base}/{cuda_tag(cuda)}/" + (f"torch{torch_line}/" if torch_line else "")


# -- the picker's decision ---------------------------------------------------------------
# The same rules as picker.js (which reads them from the picker page's table); a test runs
# both on the same inputs. Users run `python -m sageattn3 which` where torch is installed.

def picker_rows(manifest: dict, base: str | None = None) -> list[dict[str, str]]:
    """The rows of the picker table, from a manifest (what picker.js reads from the page)."""
    base = base if base is not None else manifest.get("base_url")
    wheels = manifest.get("wheels", {})
    rows = []
    for path, names in manifest.get("pages", {}).items():
        parts = path.split("/")
        if len(parts) == 2 and parts[1].startswith("torch"):
            rows.append({"line": parts[1].removeprefix("torch"), "cuda": cuda_from_tag(parts[0]), "page": path,
                         "url": _url(base, f"{path}/"), "links": _url(base, f"links/{Page(path, ()).flat_name}.html"),
                         "stable": _stable_flag(wheels[n]["variant"] for n in names)})
    rows.sort(key=lambda r: (tuple(-x for x in _line_key(r["line"])), r["page"]))
    return rows


def _dotted(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split("."))


def _sorted_unique(values) -> str:
    return ", ".join(sorted(set(values), key=_dotted))


_TORCH_VERSION = re.compile(r"(\d+)\.(\d+)([.0-9a-z]*)(?:\+([.0-9a-z]+))?", re.I | re.A)


def pick(rows: list[dict[str, str]], project: str, text: str) -> dict[str, str]:
    """What the picker answers for what a user pasted (``torch.__version__`` and optionally
    ``torch.version.cuda``): ``kind`` ("ok" with ``command``, or why not) and ``reason``."""
    tokens = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    if not tokens:
        return {"kind": "empty", "reason": f"paste what {ASK_TORCH} prints"}
    m = _TORCH_VERSION.fullmatch(tokens[0])
    if not m or len(tokens) > 2:
        return {"kind": "unparsed", "reason": f"not a torch version: {json.dumps(' '.join(tokens), ensure_ascii=False)}"
                f"; paste what {ASK_TORCH} prints, e.g. 2.14.1+cu130 13.0"}
    version, line, label = tokens[0], f"{int(m[1])}.{int(m[2])}", (m[4] or "").lower()
    cuda: str | None = None
    if label.startswith("rocm"):
        return {"kind": "rocm", "reason": f"torch {version} is a ROCm build; sageattn3 needs torch built for CUDA (NVIDIA GPUs)"}
    if len(tokens) == 2:
        c = re.fullmatch(r"(\d+)\.(\d+)", tokens[1], re.A)
        if re.fullmatch(r"none", tokens[1], re.I):
            cuda = None
        elif c:
            cuda = f"{int(c[1])}.{int(c[2])}"
        else:
            return {"kind": "unparsed", "reason": f"not a CUDA version: {json.dumps(tokens[1], ensure_ascii=False)}"
                    " (torch.version.cuda prints e.g. 13.0, or None for a CPU build)"}
    elif c := re.fullmatch(r"cu(\d+)(\d)", label, re.A):
        cuda = f"{int(c[1])}.{int(c[2])}"
    elif label != "cpu":
        return {"kind": "no-cuda", "reason": f"torch {version} does not say which CUDA it was built for; paste what "
                f"{ASK_TORCH} prints"}
    if cuda is None:
        return {"kind": "cpu", "reason": f"torch {version} is a CPU-only build; sageattn3 needs torch built for CUDA: "
                "install a CUDA build of torch, then pick again"}
    major = _dotted(cuda)[0]
    same = [r for r in rows if r["line"] == line]
    newer = ""
    stable = [r for r in rows if r["stable"] == "true"]
    if not same and stable and _dotted(line) > max(_dotted(r["line"]) for r in rows):
        # A torch line newer than every one built here: the stable-ABI wheels load into it (the
        # import guard lets them), untested; offer the newest such line of torch's CUDA major.
        majors = [r for r in stable if _dotted(r["cuda"])[0] == major]
        if not majors:
            return {"kind": "no-variant", "reason": f"no wheels for torch {line} built for CUDA {cuda}; torch {line} is "
                    f"newer than every torch line built here, and the stable-ABI wheels that load into it are served "
                    f"for CUDA {_sorted_unique(r['cuda'] for r in stable)}"}
        top = max((r["line"] for r in majors), key=_dotted)
        same = [r for r in majors if r["line"] == top]
        newer = (f"; torch {line} is newer than every torch line built here: stable-ABI wheels built against "
                 f"torch {top}, not tested with torch {line}")
    if not same:
        return {"kind": "unknown-line", "reason": f"no wheels for torch {line} on this index; it serves torch "
                f"{_sorted_unique(r['line'] for r in rows)}"}
    fits = [r for r in same if _dotted(r["cuda"])[0] == major]
    if not fits:
        return {"kind": "no-variant", "reason": f"no wheels for torch {line} built for CUDA {cuda}; torch {line} is "
                f"served for CUDA {_sorted_unique(r['cuda'] for r in same)}"}
    # Same CUDA first, else the newest not newer than torch's (a newer minor may need a newer
    # runtime than torch ships), else the oldest newer one.
    def rank(r: dict[str, str]) -> tuple:
        k = _dotted(r["cuda"])
        older = k <= _dotted(cuda)
        return (r["cuda"] == cuda, older, tuple(x if older else -x for x in k))
    best = max(fits, key=rank)
    return {"kind": "ok", "page": best["page"], "url": best["url"], "links": best["links"],
            "command": f"pip install --no-deps {project} --index-url {best['url']}",
            "reason": f"torch {line} built for CUDA {cuda}: wheels compiled with CUDA {best['cuda']}{newer}"}


def _fetch(location: str, rel: str) -> bytes:
    if "://" in location:
        url = urllib.parse.urljoin(location.rstrip("/") + "/", rel)
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read()
    return (Path(location) / rel).read_bytes()


# -- checking a served index (the crawler) ------------------------------------------------

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


def check_index(location: str, project: str = DEFAULT_PROJECT, log=print) -> int:
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


# -- CLI ----------------------------------------------------------------------------------

def _build(a) -> int:
    if a.wheels is None and (a.remove or a.yank):
        records, wheels = [], Path("dist/wheels")  # only removing/yanking: no wheels needed
    else:
        wheels = a.wheels or Path("dist/wheels")
        records = load_records(wheels, a.project)
    yank = {}
    for y in a.yank:
        w, _, reason = y.partition("=")
        if not w.endswith(".whl"):
            raise IndexError_(f"--yank {y!r}: expected WHEEL=REASON with the wheel's file name (…whl=why)")
        yank[w] = reason
    r = update_index(records, wheels, a.out, a.project, base_url=a.base_url, remove=a.remove, yank=yank)
    print(f"index {a.out}: {len(r.pages)} pages, +{len(r.added)} wheels, -{len(r.removed)} wheels, "
          f"{len(r.written)} files written, {len(r.deleted)} deleted")
    return 0


def _check(a) -> int:
    try:
        check_index(a.location)
    except IndexError_ as e:
        print(f"index check: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError) as e:  # unreachable, missing, not an index
        why = getattr(e, "reason", None) or e
        print(f"index check: cannot read an index at {a.location} ({type(e).__name__}: {why}); "
              "pass the index root (the directory or URL holding index.json)", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in ("build", "which", "check") else "build"
    ap = argparse.ArgumentParser(prog=f"python -m ci.index {cmd}")
    if cmd == "which":
        print("python -m ci.index which is gone: where torch is installed, run `python -m sageattn3 which`, "
              "or paste your torch version into the index's picker page (index.html)", file=sys.stderr)
        return 2
    if cmd == "build":
        ap.description = "Merge the wheels of a directory into a PEP 503/658 index (see ci/index.py for the layout)."
        ap.add_argument("--wheels", type=Path, default=None,
                        help="wheels with their <wheel>.json records (default dist/wheels; must exist and hold wheels)")
        ap.add_argument("--out", type=Path, default=Path("dist/index"), help="the index root (merged into when it exists)")
        ap.add_argument("--base-url", default=None, help="the URL the index root is served at (shown on the picker page)")
        ap.add_argument("--project", default=DEFAULT_PROJECT)
        ap.add_argument("--remove", action="append", default=[], metavar="WHEEL_OR_VERSION",
                        help="drop a wheel (file name) or a version (1.0.0 = every variant of it); repeatable")
        ap.add_argument("--yank", action="append", default=[], metavar="WHEEL=REASON", help="mark a wheel yanked (PEP 592)")
        run = _build
    else:
        ap.description = "Crawl an index (URL or directory): every link, sha256 and .metadata."
        ap.add_argument("location")
        run = _check
    a = ap.parse_args(argv)
    try:
        return run(a)
    except (IndexError_, RecordError) as e:  # bad input: nothing was written
        print(f"index: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"index: {e.strerror or e}: {e.filename or ''} (nothing half-written is left: files are replaced whole)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
