"""The pieces ``ci.release.publish.github`` is made of: the tag rule, the local assets of a wheels
directory, the ``SHA256SUMS`` text, and PyGithub objects per thread."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ci.release.publish._net import InputError
from ci.stages.record import BuildRecord, record_path, sha256_of

SUMS = "SHA256SUMS"


@dataclass(frozen=True)
class LocalAsset:
    name: str
    sha256: str
    size: int
    kind: str  # "wheel", "record" or "sums"
    path: Path | None = None
    data: bytes | None = None

    def open(self):
        return open(self.path, "rb") if self.path is not None else io.BytesIO(self.data or b"")

    @classmethod
    def from_bytes(cls, name: str, data: bytes, kind: str) -> "LocalAsset":
        import hashlib

        return cls(name, hashlib.sha256(data).hexdigest(), len(data), kind, data=data)


def check_tag(tag: str, records: list[BuildRecord]) -> None:
    """The release tag must be ``v`` + the (public, PEP 440 normalised) version that every
    wheel carries: ``v0.1.0`` for ``0.1.0+cu130.torch2.10.stable``."""
    versions: dict[str, str] = {}  # public version -> one wheel that has it
    for rec in records:
        versions.setdefault(Version(rec.version).public, rec.wheel)
    if len(versions) > 1:
        (a, wa), (b, wb) = sorted(versions.items())[:2]
        raise InputError(f"{wb}: version: {b}, but {wa} is {a}; one release holds one version: "
                         "publish each version from its own wheels directory")
    (version, wheel), = versions.items()
    want = f"v{version}"
    if tag == want:
        return
    try:
        said = Version(tag[1:]) if tag.startswith("v") else None
    except InvalidVersion:
        said = None
    why = ("is empty" if not tag else "is not v + a version" if said is None else
           f"is not the wheels' version {version}")
    raise InputError(f"--tag {tag!r} {why} ({wheel}: version {version}); use --tag {want}")


def assets_of(wheels_dir: Path, records: list[BuildRecord]) -> list[LocalAsset]:
    out: list[LocalAsset] = []
    for rec in records:
        w = wheels_dir / rec.wheel
        out.append(LocalAsset(rec.wheel, rec.sha256, w.stat().st_size, "wheel", path=w))
        rp = record_path(w)
        out.append(LocalAsset(rp.name, sha256_of(rp), rp.stat().st_size, "record", path=rp))
    return out


def sums_text(shas: dict[str, str]) -> bytes:
    return "".join(f"{shas[n]}  {n}\n" for n in sorted(shas)).encode()


def parse_sums(data: bytes) -> dict[str, str]:
    out = {}
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and len(parts[0]) == 64:
            out[parts[1].lstrip("*")] = parts[0].lower()
    return out


def _raw(obj) -> dict:
    """The JSON an object was built from, without PyGithub completing it (which would cost
    one GET per asset whose JSON lacks an attribute, e.g. ``digest`` on older servers)."""
    from github.GithubObject import GithubObject

    return GithubObject.raw_data.fget(obj)  # type: ignore[attr-defined]


class _Client:
    """PyGithub objects per thread: PyGithub's connection object is not thread-safe."""

    def __init__(self, opts, token: str | None) -> None:
        self.opts = opts
        self._token = token
        self._tls = threading.local()

    @property
    def has_token(self) -> bool:
        return bool(self._token)

    def gh(self):
        g = getattr(self._tls, "gh", None)
        if g is None:
            from github import Auth, Github

            g = Github(base_url=self.opts.api_url.rstrip("/"), auth=Auth.Token(self._token) if self._token else None,
                       timeout=self.opts.timeout, per_page=100, retry=None, pool_size=2, lazy=True,
                       seconds_between_requests=None, seconds_between_writes=None)
            self._tls.gh = g
        return g

    def repo(self):
        return self.gh().get_repo(self.opts.repo)  # lazy client: no request

    def release(self, raw: dict):
        from github.GitRelease import GitRelease

        return self.gh().create_from_raw_data(GitRelease, raw)

    def download(self, asset_raw: dict) -> bytes:
        """An asset's bytes: the API URL with Accept: octet-stream redirects to storage,
        which gets no Authorization header (signed URL)."""
        import requests

        headers = {"Accept": "application/octet-stream"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        r = requests.get(asset_raw["url"], headers=headers, allow_redirects=False, timeout=self.opts.timeout)
        if r.status_code in (301, 302, 303, 307, 308):
            r = requests.get(r.headers["Location"], timeout=self.opts.timeout)
        if r.status_code != 200:
            from github import GithubException

            raise GithubException(r.status_code, {"message": f"download of {asset_raw.get('name')}"}, dict(r.headers))
        return r.content
