"""Is ``ci/targets.toml`` still what PyTorch publishes? (``python -m ci matrix --check-upstream``)

Reads torch's file list from a PEP 503/691 simple index (PyPI by default) and, when given,
from PyTorch's own index (one directory per CUDA variant, ``<root>/cu130/torch/``), and lists
every difference with the matrix:

- a torch release line newer than the matrix's newest line;
- a newer patch release of a line than its ``build_version``;
- Pythons a line lists that its ``build_version`` has no wheel for, and Pythons it has that the
  line does not list (free-threaded builds aside: the wheels are abi3);
- an OS of a line with no wheel of its ``build_version``;
- with PyTorch's index: CUDA variants listed for an OS that the index does not serve there,
  and variants it serves that the line does not list.

Nothing is changed: the report says what to edit. Exit status 0: in step; 1: differences;
2: an index could not be read.

A missing page is "absent" whether the index answers 404 (PyPI, pip's own stand-ins) or 403
(PyTorch's index, served from a bucket that refuses paths it does not hold); any other answer
is an error naming the URL.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from ci.index import parse_anchors
from ci.runtime.log import default_log
from ci.toolchain.targets import Matrix, TorchLine
from ci.toolchain.variant import cuda_tag
from ci.runtime.errors import FactoryError

PYPI_SIMPLE = "https://pypi.org/simple"
# The platform tag of each matrix OS (any manylinux glibc level).
OS_PLATFORM = {
    "linux-x86_64": re.compile(r"^(manylinux\w*_x86_64|linux_x86_64)$"),
    "linux-aarch64": re.compile(r"^(manylinux\w*_aarch64|linux_aarch64)$"),
    "windows-amd64": re.compile(r"^win_amd64$"),
}
# What an index answers for a page it does not hold: 404, or 403 from a storage bucket
# (download.pytorch.org answers 403 for every missing path).
ABSENT_STATUSES = (403, 404)
# CUDA variants probed on PyTorch's index beyond those the matrix names (cu118 ... cu139).
PROBED_CUDA = tuple(f"{major}.{minor}" for major in (11, 12, 13) for minor in range(10)
                    if (major, minor) >= (11, 8))


class UpstreamError(FactoryError, RuntimeError):
    """An index could not be read; the message names the URL."""


@dataclass(frozen=True)
class TorchFile:
    version: Version
    python: str  # "3.12"
    platform: str  # "manylinux_2_28_x86_64"


def project_files(index_url: str, project: str = "torch", timeout: float = 60) -> list[str] | None:
    """The file names a simple index lists for ``project`` (None: the index has no such page,
    answered 404 or 403). Asks for PEP 691 JSON and reads PEP 503 HTML when that is what comes
    back."""
    url = f"{index_url.rstrip('/')}/{project}/"
    req = urllib.request.Request(url, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            ctype = resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        if e.code in ABSENT_STATUSES:
            return None
        raise UpstreamError(f"{url}: HTTP {e.code} {e.reason} (only 403 and 404 mean the page is absent)") from None
    except (urllib.error.URLError, OSError) as e:
        raise UpstreamError(f"{url}: {getattr(e, 'reason', e)}") from None
    if "json" in ctype:
        try:
            return [f["filename"] for f in json.loads(body)["files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise UpstreamError(f"{url}: not a PEP 691 project page ({e})") from None
    names = [urllib.parse.unquote(urllib.parse.urlsplit(a.get("href") or "").path.rstrip("/").rsplit("/", 1)[-1])
             for a in parse_anchors(body)]
    return [n for n in names if n]


def torch_wheels(names: list[str]) -> list[TorchFile]:
    """The CPython torch wheels among ``names`` (free-threaded ``cp313t`` builds left out)."""
    out = []
    for name in names:
        if not name.endswith(".whl"):
            continue
        try:
            _, version, _, tags = parse_wheel_filename(name)
        except (InvalidWheelFilename, InvalidVersion):
            continue
        for tag in tags:
            m = re.fullmatch(r"cp3(\d+)", tag.interpreter)
            if m and not tag.abi.endswith("t"):
                out.append(TorchFile(version, f"3.{m.group(1)}", tag.platform))
    return out


@dataclass
class Drift:
    """What differs, one line each, grouped by what to change."""

    lines: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.lines.append(text)

    def compare(self, listed: set[str], found: set[str], missing, unlisted) -> None:
        """One line per version listed but not found (``missing(v)``) and found but not listed
        (``unlisted(v)``), in version order."""
        for v in sorted(listed - found, key=Version):
            self.add(missing(v))
        for v in sorted(found - listed, key=Version):
            self.add(unlisted(v))

    def markdown(self, source: str) -> str:
        if not self.lines:
            return f"`ci/targets.toml` matches {source}.\n"
        items = "\n".join(f"- {ln}" for ln in self.lines)
        return (f"`ci/targets.toml` differs from {source} ({len(self.lines)} "
                f"difference{'s' if len(self.lines) != 1 else ''}):\n\n{items}\n")


def _line_of(v: Version) -> str:
    return f"{v.major}.{v.minor}"


def check_pypi(matrix: Matrix, files: list[TorchFile], drift: Drift) -> None:
    releases = sorted({f.version for f in files if not f.version.is_prerelease and not f.version.is_devrelease})
    by_line: dict[str, list[Version]] = {}
    for v in releases:
        by_line.setdefault(_line_of(v), []).append(v)
    newest_line = max((Version(t.line) for t in matrix.torch), default=Version("0"))
    for line, versions in sorted(by_line.items(), key=lambda kv: Version(kv[0])):
        if Version(line) > newest_line:
            pys = sorted({f.python for f in files if f.version == versions[-1]}, key=Version)
            drift.add(f"torch {line} is released ({versions[-1]}, Pythons {', '.join(pys)}) and no line of "
                      f"ci/targets.toml names it: add a [[torch]] entry")
    for t in matrix.torch:
        _check_line(t, files, by_line.get(t.line, []), drift)


def _check_line(t: TorchLine, files: list[TorchFile], versions: list[Version], drift: Drift) -> None:
    build = Version(t.build_version)
    mine = [f for f in files if f.version.public == build.public]
    if not mine:
        drift.add(f"torch {t.line}: build_version {t.build_version} has no wheel on the index")
        return
    newer = [v for v in versions if v > build]
    if newer:
        drift.add(f"torch {t.line}: {newer[-1]} is released; build_version is {t.build_version}")
    drift.compare(set(t.python), {f.python for f in mine},
                  lambda py: f"torch {t.line}: python lists {py}, but torch {t.build_version} has no "
                             f"cp{py.replace('.', '')} wheel: remove it",
                  lambda py: f"torch {t.line}: torch {t.build_version} has cp{py.replace('.', '')} wheels, python "
                             f"does not list {py}")
    for os_key in t.os:
        plat = OS_PLATFORM.get(os_key)
        if plat and not any(plat.match(f.platform) for f in mine):
            drift.add(f"torch {t.line}: os lists {os_key}, but torch {t.build_version} has no wheel for it")


def check_pytorch_index(matrix: Matrix, root: str, drift: Drift, log=default_log) -> None:
    """Per line and OS: the CUDA variants PyTorch's index serves ``build_version`` for, against
    ``published_on(os)``."""
    probed = sorted(set(PROBED_CUDA) | {c for t in matrix.torch for c in t.published}, key=Version)
    serves: dict[str, list[TorchFile]] = {}
    for cuda in probed:
        names = project_files(f"{root.rstrip('/')}/{cuda_tag(cuda)}")
        if names:
            serves[cuda] = torch_wheels(names)
    log(f"[upstream] {root}: torch under {', '.join(cuda_tag(c) for c in serves) or 'no CUDA directory'}")
    for t in matrix.torch:
        build = Version(t.build_version)
        for os_key in t.os:
            plat = OS_PLATFORM[os_key]
            there = {c for c, fs in serves.items()
                     if any(f.version.public == build.public and plat.match(f.platform) for f in fs)}
            drift.compare(set(t.published_on(os_key)), there,
                          lambda c: f"torch {t.line} on {os_key}: CUDA {c} is listed as published, but "
                                    f"{root}/{cuda_tag(c)} has no torch {t.build_version} wheel for it: drop it "
                                    f"for {os_key} (published_by_os)",
                          lambda c: f"torch {t.line} on {os_key}: {root}/{cuda_tag(c)} serves torch "
                                    f"{t.build_version}, but CUDA {c} is not listed as published there")


def check_upstream(matrix: Matrix, index_url: str = PYPI_SIMPLE, pytorch_index: str | None = None,
                   log=default_log) -> Drift:
    drift = Drift()
    names = project_files(index_url)
    if names is None:
        raise UpstreamError(f"{index_url}: has no torch project page")
    files = torch_wheels(names)
    log(f"[upstream] {index_url}: {len(files)} torch wheels")
    check_pypi(matrix, files, drift)
    if pytorch_index:
        check_pytorch_index(matrix, pytorch_index, drift, log=log)
    return drift
