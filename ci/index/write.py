"""Writing the index: the manifest (``index.json``) merged with new records, removals and yanks,
then every page and file written (only what changed), and the files a site update needs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from ci.index.html import render
from ci.index.layout import DEFAULT_PROJECT, MANIFEST, MANIFEST_FORMAT, Entry, IndexError_, Page, _short
from ci.stages.record import BuildRecord, RecordError, check_wheel, sha256_of, wheel_metadata
from ci.stages.wheel_hygiene import UnsafeWheel, check_distinct


@dataclass
class IndexResult:
    pages: list[Page]
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # files (re)written, relative to the root
    deleted: list[str] = field(default_factory=list)


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
    missing = d.get("missing", {})
    if not isinstance(missing, dict) or not all(
            isinstance(v, dict) and all(isinstance(t, str) and isinstance(w, str) for t, w in v.items())
            for v in missing.values()):
        raise IndexError_(f"{where}: field missing: {_short(missing)}, expected an object "
                          "(release version -> {target id -> why})")
    return d


def release_version(records: list[BuildRecord]) -> str:
    """The one release (public version) ``records`` belong to; IndexError_ when they are of none
    or of several (a partial release's missing targets are stated per release)."""
    versions = {parse_wheel_filename(r.wheel)[1].public for r in records}
    if len(versions) != 1:
        raise IndexError_(f"the missing targets of a release need the wheels of exactly one release, these are of "
                          f"{', '.join(sorted(versions)) or 'none'}: pass one release's wheels (--wheels)")
    return versions.pop()


def merge_missing(old: dict, new: dict[str, dict[str, str]], entries: dict) -> dict[str, dict[str, str]]:
    """The index's missing targets per release: ``old`` (the manifest's) with each release of
    ``new`` replaced, then every target that has a wheel of that release in ``entries`` dropped
    (a re-run published it), and releases with nothing missing dropped."""
    if not old and not new:
        return {}
    merged = {v: dict(t) for v, t in {**old, **new}.items()}
    have = {(parse_wheel_filename(w)[1].public, e.record.target) for w, e in entries.items()}
    out = {}
    for version, targets in sorted(merged.items()):
        left = {t: why for t, why in sorted(targets.items()) if (version, t) not in have}
        if left:
            out[version] = left
    return out


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


def _remove(entries: dict, remove, where: str) -> list[str]:
    """Drop the entries each ``--remove`` spec names (a wheel name or a version); a spec that
    names none is an error. Returns the removed wheel names."""
    removed = []
    for spec in remove:
        hits = [w for w in entries if _matches_removal(w, spec)]
        if not hits:
            raise IndexError_(f"--remove {spec!r}: no {where} wheel has that name or version")
        for w in hits:
            del entries[w]
            removed.append(w)
    return removed


def write_index(records: list[BuildRecord], wheels_dir: Path, out: Path, project: str = DEFAULT_PROJECT,
                *, base_url: str | None = None, remove: tuple[str, ...] | list[str] = (),
                yank: dict[str, str] | None = None, missing: dict[str, str] | None = None) -> list[Page]:
    """Merge ``records`` (wheels in ``wheels_dir``) into the index at ``out`` and bring every
    page up to date. Returns the pages. See :func:`update_index` for the details."""
    return update_index(records, wheels_dir, out, project, base_url=base_url, remove=remove, yank=yank,
                        missing=missing).pages


def update_index(records: list[BuildRecord], wheels_dir: Path, out: Path, project: str = DEFAULT_PROJECT,
                 *, base_url: str | None = None, remove: tuple[str, ...] | list[str] = (),
                 yank: dict[str, str] | None = None, missing: dict[str, str] | None = None) -> IndexResult:
    """Merge and write. Earlier wheels stay unless a ``remove`` spec names them (file name or
    version); ``yank`` maps a wheel name to a reason (PEP 592). A wheel name already indexed
    with another sha256 is refused. Idempotent: unchanged inputs rewrite nothing. When
    ``base_url`` is None the one remembered in the manifest is kept. ``missing``: the targets
    the release of ``records`` lacks (target id -> why: ci.stages.provenance.missing_targets),
    named on the root page until a wheel of each is indexed."""
    wheels_dir, out = Path(wheels_dir), Path(out)
    files = out / "files"
    old = load_manifest(out)
    if base_url is None:
        base_url = old.get("base_url")
    entries = manifest_entries(old, str(out / MANIFEST))
    old_pages = set(old.get("pages", {}))
    result = IndexResult(pages=[])

    result.removed += _remove(entries, remove, "indexed")
    new_missing = {release_version(records): dict(missing)} if missing is not None else {}

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
    try:  # a new wheel may not shadow an indexed one under another name (same version and tag)
        check_distinct([*entries, *(r.wheel for r in to_add)], f"(already in {out / MANIFEST})")
    except UnsafeWheel as e:
        raise IndexError_(str(e)) from None
    for w in yank or {}:
        if w not in entries and w not in {r.wheel for r in to_add}:
            raise IndexError_(f"--yank {w!r}: not an indexed wheel")

    _add_files(to_add, entries, files, wheels_dir, result)

    for w, reason in (yank or {}).items():
        entries[w] = Entry(entries[w].record, entries[w].metadata_sha256, reason or "")

    present = set(os.listdir(files)) if files.is_dir() else set()
    missing = [w for w in entries if w not in present or w + ".metadata" not in present]
    if missing:
        raise IndexError_(
            f"{out}: the manifest lists wheels whose files are gone: {', '.join(sorted(missing)[:5])}"
            f"{' …' if len(missing) > 5 else ''}; restore them or --remove them"
        )

    pages, generated = render(entries, project, base_url, merge_missing(old.get("missing", {}), new_missing, entries))
    for rel, data in generated.items():
        if _write_bytes(out / rel, data):
            result.written.append(rel)
    _delete_stale(out, old_pages, pages, project, result)
    result.pages = pages
    return result


def _add_files(to_add: list, entries: dict, files: Path, wheels_dir: Path, result) -> None:
    """Each checked new wheel into ``files/`` (hashed and copied from one read; its METADATA
    taken from the copy)
    with its ``.metadata`` file, and into ``entries``; what was written or added into ``result``."""
    for rec in to_add:
        dst = files / rec.wheel
        have = entries.get(rec.wheel)
        if not dst.exists():
            src = wheels_dir / rec.wheel
            data = src.read_bytes()  # read once: hashed and copied
            if hashlib.sha256(data).hexdigest() != rec.sha256:  # changed since it was checked
                raise IndexError_(f"{rec.wheel}: its record's sha256 does not match {src}; rebuild it")
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
            result.written.append(f"files/{rec.wheel}")
            try:  # from the copy just written (the same bytes, hashed above)
                meta = wheel_metadata(dst)
            except RecordError as e:
                raise IndexError_(str(e)) from None
        else:
            meta = wheel_metadata(dst)
        if _write_bytes(files / (rec.wheel + ".metadata"), meta):
            result.written.append(f"files/{rec.wheel}.metadata")
        entries[rec.wheel] = Entry(rec, hashlib.sha256(meta).hexdigest(), have.yanked if have else None)
        if have is None:
            result.added.append(rec.wheel)


def _delete_stale(out: Path, old_pages: set, pages: list, project: str, result) -> None:
    """The pages no longer produced (after a removal) and the files of removed wheels, deleted."""
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
    old_generated = set(render(entries, project, remote.get("base_url"), remote.get("missing"))[1]) if entries else set()
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
    try:
        check_distinct(entries, f"(in the published {MANIFEST} or {Path(local_dir) / MANIFEST})")
    except UnsafeWheel as e:
        raise IndexError_(str(e)) from None
    removed = _remove(entries, remove, "published")
    base = base_url or local.get("base_url") or remote.get("base_url")
    # the local index states the missing targets of the release it was built for: those replace
    # the published statement of that release; a target published since is no longer named
    missing = merge_missing(remote.get("missing", {}), local.get("missing", {}), entries)
    _, generated = render(entries, project, base, missing)
    files: dict[str, bytes | Path] = dict(generated)
    for name in local.get("wheels", {}):
        if name in entries:
            files[f"files/{name}"] = Path(local_dir) / "files" / name
            files[f"files/{name}.metadata"] = Path(local_dir) / "files" / (name + ".metadata")
    deletions = (old_generated - set(generated)) | {f"files/{w}{x}" for w in removed for x in ("", ".metadata")}
    return files, deletions, added


# The same rules as picker.js (which reads them from the picker page's table); a test runs
# both on the same inputs. Users run `python -m sageattn3 which` where torch is installed.


