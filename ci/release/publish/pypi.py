"""twine uploads to PyPI-compatible servers, and the unlabelled default variant for PyPI.

Two modes:

- **all variants** (any server that accepts PEP 440 local versions, e.g. pypiserver or a
  devpi index): every labelled wheel of ``dist/wheels``, ``twine upload --skip-existing``.
- **PyPI mode** (automatic for ``*.pypi.org`` URLs, or ``--pypi``): PyPI refuses local
  version labels, so only one variant goes there, as a plain version. The default variant
  is the one that serves what ``pip install torch`` gives from PyPI: the newest torch line of
  ``ci/targets.toml`` with its ``pypi_default`` CUDA (with this commit's matrix
  ``cu132.torch2.10.stable``; a test checks this line against ``default_variant_from_matrix``),
  or ``--default-variant``. Each of its wheels (one per OS/arch) is **derived** by rewriting
  only the version: ``sageattn3-1.0.0+cu130.torch2.10.stable-<tags>.whl`` becomes
  ``sageattn3-1.0.0-<tags>.whl`` (``.dist-info`` directory, ``METADATA`` ``Version:`` and
  ``RECORD`` hashes rewritten; every other byte identical, so the build record inside still
  names the variant). Users of other torch/CUDA builds use the per-variant index.

Skip-existing is done here, not by twine (twine 6+ refuses ``--skip-existing`` for servers it
does not know): the server's PEP 503 page for the project (``--simple-url``; default
``https://pypi.org/simple/`` for PyPI, ``<repository-url>/simple/`` otherwise, as pypiserver
serves it) is read first; a file already there with the same sha256 is skipped, one with
another sha256 is an error (an index never changes a published file), the rest go to twine.

Credentials are twine's own environment variables (``TWINE_USERNAME``, ``TWINE_PASSWORD``;
``__token__`` + an API token for PyPI); nothing is passed on a command line, and twine's
output is redacted before it is printed. A server that needs no authentication (pypiserver
``-a . -P .``, a devpi index open to all) needs no variables: without them twine is given
placeholder credentials, which such a server ignores and any other refuses (the message says
which variables to set). twine runs without colours or progress bars: its output goes to logs.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from packaging.utils import parse_wheel_filename
from packaging.version import Version

from ci.release.publish._net import InputError, PublishError, Redactor
from ci.runtime.log import default_log
from ci.stages.record import BuildRecord, RecordError, load_records
from ci.toolchain.variant import Variant
from ci.stages.wheel_hygiene import UnsafeWheel, check_distinct
from ci.runtime.env import FactoryEnv, child_environ


@dataclass(frozen=True)
class UploadOptions:
    repository_url: str
    wheels: Path = Path("dist/wheels")
    pypi: bool | None = None  # None: decide from the URL
    default_variant: str | None = None
    out: Path = Path("dist/pypi")
    dry_run: bool = False
    simple_url: str | None = None
    timeout: int = 600


def is_pypi(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    return host == "pypi.org" or host.endswith(".pypi.org")


def default_variant_from_matrix() -> str:
    """The variant serving torch's newest line as PyPI ships it (its pypi_default CUDA)."""
    from ci.toolchain.targets import Matrix

    m = Matrix.load()
    newest = max(m.torch, key=lambda t: Version(t.line))
    cands = sorted({t.variant for t in m.targets if t.variant.serves(f"{newest.line}.0", newest.pypi_default)
                    and newest.line in t.torch_lines and t.cuda == newest.pypi_default})
    if not cands:
        raise PublishError(f"no target serves torch {newest.line} with CUDA {newest.pypi_default} (PyPI's default); "
                           "pass --default-variant")
    return str(cands[-1])


def select_default(records: list[BuildRecord], variant: str) -> list[BuildRecord]:
    """The newest version's wheels of that variant (one per platform tag)."""
    Variant.parse(variant)
    mine = [r for r in records if r.variant == variant]
    if not mine:
        have = sorted({r.variant for r in records})
        raise InputError(f"no wheel of the default variant {variant} in the wheels directory (have: {', '.join(have) or 'none'}); "
                         "pass --default-variant or --all-variants")
    newest = max(Version(Version(r.version).public) for r in mine)  # as versions: 1.10 > 1.9
    return sorted((r for r in mine if Version(Version(r.version).public) == newest), key=lambda r: r.wheel)


def _b64(d: bytes) -> str:
    return base64.urlsafe_b64encode(d).rstrip(b"=").decode()


def derive_unlabelled(wheel: Path, out_dir: Path) -> Path:
    """A copy of the wheel with the local label dropped from its version (see the module doc)."""
    name, version, build, tags = parse_wheel_filename(wheel.name)
    if version.local is None:
        return wheel
    plain = version.public
    stem_old = wheel.name.split("-")[0]
    old_info = f"{stem_old}-{version}.dist-info/"
    new_info = f"{stem_old}-{plain}.dist-info/"
    new_name = wheel.name.replace(f"-{version}-", f"-{plain}-", 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / new_name
    entries: list[tuple[zipfile.ZipInfo, bytes]] = []
    with zipfile.ZipFile(wheel) as zin:
        for zi in zin.infolist():
            data = zin.read(zi)
            n = zi.filename
            if n.startswith(old_info):
                n = new_info + n[len(old_info):]
                if n == new_info + "METADATA":
                    lines = data.decode("utf-8").split("\n")
                    lines = [f"Version: {plain}" if ln.startswith("Version: ") else ln for ln in lines]
                    data = "\n".join(lines).encode("utf-8")
            nzi = zipfile.ZipInfo(n, date_time=zi.date_time)
            nzi.external_attr, nzi.compress_type, nzi.create_system = zi.external_attr, zi.compress_type, zi.create_system
            entries.append((nzi, data))
    record_name = new_info + "RECORD"
    rows = []
    for zi, data in entries:
        if zi.filename == record_name:
            rows.append(f"{record_name},,")
        else:
            rows.append(f"{zi.filename},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}")
    record = ("\n".join(rows) + "\n").encode()
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zout:
        for zi, data in entries:
            zout.writestr(zi, record if zi.filename == record_name else data)
    os.replace(tmp, dst)
    return dst


def simple_url_for(repository_url: str) -> str:
    host = urllib.parse.urlsplit(repository_url).hostname or ""
    if is_pypi(repository_url):
        return "https://test.pypi.org/simple/" if host.startswith("test.") else "https://pypi.org/simple/"
    return urllib.parse.urljoin(repository_url.rstrip("/") + "/", "simple/")


def existing_files(simple_url: str, project: str, send_auth: bool) -> dict[str, str | None]:
    """File name -> sha256 (None when the page gives none) of what the server already has."""
    import urllib.request
    from urllib.error import HTTPError

    from packaging.utils import canonicalize_name

    from ci.index import parse_anchors

    url = urllib.parse.urljoin(simple_url.rstrip("/") + "/", canonicalize_name(project) + "/")
    req = urllib.request.Request(url, headers={"Accept": "text/html"})
    env = FactoryEnv.from_environ()
    user, pw = env.twine_username, env.twine_password
    if send_auth and user and pw:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            page = r.read()
    except HTTPError as e:
        if e.code == 404:
            return {}
        raise PublishError(f"reading {url} to skip existing files: HTTP {e.code}"
                           + ("; the server wants credentials: set TWINE_USERNAME and TWINE_PASSWORD" if e.code in (401, 403) else "")
                           ) from None
    except OSError as e:  # refused, unreachable, timed out
        reason = getattr(e, "reason", None) or e
        raise PublishError(f"reading {url} to skip existing files: {reason}; is --repository-url right "
                           "(or pass --simple-url)?") from None
    out: dict[str, str | None] = {}
    for a in parse_anchors(page):
        parts = urllib.parse.urlsplit(a.get("href") or "")
        name = urllib.parse.unquote(parts.path.rsplit("/", 1)[-1])
        out[name] = parts.fragment.removeprefix("sha256=") if parts.fragment.startswith("sha256=") else None
    return out


ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def twine_env(repository_url: str, log: Callable[[str], None]) -> dict[str, str]:
    """twine's environment: no colours, never a prompt, and placeholder credentials for a
    server without authentication when none are set (twine refuses to run without)."""
    env = child_environ(drop=("FORCE_COLOR", "CLICOLOR_FORCE", "PY_COLORS"))
    env.update(NO_COLOR="1", TERM="dumb", TWINE_NON_INTERACTIVE="1")
    if not is_pypi(repository_url) and not env.get("TWINE_USERNAME") and not env.get("TWINE_PASSWORD"):
        log("  no TWINE_USERNAME/TWINE_PASSWORD set: uploading without credentials (servers that need them refuse)")
        env.update(TWINE_USERNAME="anonymous", TWINE_PASSWORD="none",
                   PYTHON_KEYRING_BACKEND="keyring.backends.null.Keyring")
    return env


def _twine(files: list[Path], url: str, timeout: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "twine", "--no-color", "upload", "--non-interactive",
           "--disable-progress-bar", "--repository-url", url, *map(str, files)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise PublishError(f"twine upload to {url} did not finish in {timeout} s; re-run (files already "
                           "on the server are skipped)") from None


def upload_index(opts: UploadOptions, log: Callable[[str], None] = default_log) -> int:
    redact = Redactor.from_env()
    parts = urllib.parse.urlsplit(opts.repository_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"--repository-url {opts.repository_url!r}: not an http(s) URL "
                         "(e.g. https://upload.pypi.org/legacy/ or http://127.0.0.1:8080/)")
    try:
        records = load_records(opts.wheels)
    except RecordError as e:
        raise InputError(str(e)) from None
    pypi = is_pypi(opts.repository_url) if opts.pypi is None else opts.pypi
    if pypi:
        variant = opts.default_variant or default_variant_from_matrix()
        try:
            Variant.parse(variant)
        except ValueError as e:
            raise InputError(f"--default-variant: {e}") from None
        chosen = select_default(records, variant)
        others = sorted({r.variant for r in records} - {variant})
        log(f"PyPI mode: PyPI refuses local version labels (+{variant}), so only the default variant {variant} is "
            f"uploaded, as plain version {Version(chosen[0].version).public} ({len(chosen)} wheel(s)). "
            + (f"Not uploaded: {', '.join(others)} (they are on GitHub Releases and the per-variant index)." if others else ""))
        files = [derive_unlabelled(opts.wheels / r.wheel, opts.out) for r in chosen]
    else:
        files = [opts.wheels / r.wheel for r in records]
    from ci.stages.record import sha256_of

    have = existing_files(opts.simple_url or simple_url_for(opts.repository_url), "sageattn3",
                          send_auth=not is_pypi(opts.repository_url))
    try:  # a file the server has under another name with the same version and tag: pip takes either
        check_distinct([*have, *(f.name for f in files)], "(on the server)")
    except UnsafeWheel as e:
        raise InputError(f"{e}; remove it from the server first") from None
    todo, skipped = [], 0
    for f in files:
        if f.name in have:
            if have[f.name] not in (None, sha256_of(f)):
                raise PublishError(f"{f.name}: the server already has a different file under this name; "
                                   "a published file never changes: bump the version")
            skipped += 1
            log(f"  skip {f.name} (already on the server)")
            continue
        todo.append(f)
        log(f"  {'would upload' if opts.dry_run else 'upload'} {f.name}")
    if opts.dry_run or not todo:
        log(f"uploaded 0, skipped {skipped} (already on the server)" + (" (dry run)" if opts.dry_run else ""))
        return 0
    files = todo
    p = _twine(files, opts.repository_url, opts.timeout, twine_env(opts.repository_url, log))
    output = ANSI.sub("", p.stdout + p.stderr)
    for line in output.splitlines():
        if line.strip():
            log(redact(f"  twine: {line.rstrip()}"))
    if p.returncode != 0:
        hint = ("; the server refused the credentials: set TWINE_USERNAME and TWINE_PASSWORD"
                if re.search(r"\b(401|403)\b", output) else "; see its output above")
        raise PublishError(f"twine upload to {redact(opts.repository_url)} failed (exit {p.returncode}){hint}")
    log(f"uploaded {len(files)}, skipped {skipped} (already on the server)")
    return 0
