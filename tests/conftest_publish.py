"""Helpers for the index and publishing tests: tiny but valid wheels (with build records
beside them), a stand-in ``torch`` distribution, a loopback static HTTP server and fresh
virtual environments driven by the real pip. Imported by the test modules (not a conftest:
it holds no fixtures pytest must discover)."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

from packaging.tags import sys_tags

from ci.stages.record import RECORD_IN_WHEEL, BuildRecord, record_path
from ci.toolchain.variant import Variant

REPO = Path(__file__).resolve().parents[1]
# The platform tag of this interpreter, so pip here accepts the synthetic wheels.
PLATFORM = next(t.platform for t in sys_tags() if t.platform != "any")


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build_wheel(out: Path, name: str, version: str, tag: str = "py3-none-any", *,
                requires: tuple[str, ...] = (), requires_python: str | None = None,
                files: dict[str, bytes] | None = None) -> Path:
    """A valid wheel: METADATA, WHEEL, RECORD with hashes; fixed timestamps (deterministic)."""
    out.mkdir(parents=True, exist_ok=True)
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    if requires_python:
        meta.append(f"Requires-Python: {requires_python}")
    meta += [f"Requires-Dist: {r}" for r in requires]
    content = dict(files or {})
    content[f"{info}/METADATA"] = ("\n".join(meta) + "\n\n").encode()
    content[f"{info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: false\nTag: {tag}\n").encode()
    record = [f"{p},sha256={_b64(hashlib.sha256(b).digest())},{len(b)}" for p, b in content.items()]
    record.append(f"{info}/RECORD,,")
    content[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = out / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, b in content.items():
            zi = zipfile.ZipInfo(p, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            z.writestr(zi, b)
    return path


def sage_wheel(out: Path, variant: str, version: str = "1.0.0", *, torch_lines: tuple[str, ...] | None = None,
               platform: str = PLATFORM, payload: bytes = b"", requires_python: str = ">=3.10",
               os_key: str | None = None, target: str | None = None,
               index_url: str = "https://octo.github.io/sageattn3/") -> tuple[Path, BuildRecord]:
    """A synthetic sageattn3 wheel for a variant, carrying its build record inside (as the
    factory's wheels do) and with the beside-record next to it; its record names the index a
    release-pipeline build names (``index_url``) unless told otherwise. Its module says which variant
    it is (tests import it to see what pip picked)."""
    v = Variant.parse(variant)
    lines = torch_lines or (tuple(f"2.{m}" for m in range(int(v.torch.split('.')[1]), 15)) if v.stable else (v.torch,))
    full = f"{version}+{variant}"
    inner = BuildRecord(
        target=target or f"test-{v.cuda_tag}-torch{v.torch}", variant=variant, version=full, requires_torch=v.requires_torch,
        requires_python=requires_python, torch_build="", cuda=v.cuda, archs=("sm_120a",),
        os=os_key or os_key_of(platform), toolchain={}, flags={}, patches=(), source_commit="0" * 40,
        index_url=index_url, extra={"torch_lines": list(lines)},
    )
    inside = {k: val for k, val in json.loads(inner.to_json()).items() if k not in ("wheel", "sha256", "size")}
    files = {"sageattn3/__init__.py": f"VARIANT = {variant!r}\nVERSION = {full!r}\n".encode(),
             RECORD_IN_WHEEL: (json.dumps(inside, indent=2, sort_keys=True) + "\n").encode()}
    if payload:
        files["sageattn3/_payload.bin"] = payload
    wheel = build_wheel(out, "sageattn3", full, f"cp310-abi3-{platform}",
                        requires=(v.requires_torch,), requires_python=requires_python, files=files)
    rec = inner.with_wheel(wheel)
    record_path(wheel).write_text(rec.to_json())
    return wheel, rec


def os_key_of(platform: str) -> str:
    """The build record's os key for a platform tag (linux_x86_64 -> linux-x86_64)."""
    if platform == "win_amd64":
        return "windows-amd64"
    return "linux-" + ("aarch64" if platform.endswith("aarch64") else "x86_64")


def rewrite_wheel(wheel: Path, changes: dict[str, bytes | None], new_name: str | None = None) -> Path:
    """A doctored copy of a wheel: members replaced (bytes), added, or dropped (None), RECORD
    rewritten to match (so only what the test changes disagrees), optionally under a new
    name. Replaces the wheel when the name is kept."""
    with zipfile.ZipFile(wheel) as z:
        content = {n: z.read(n) for n in z.namelist()}
    for n, data in changes.items():
        if data is None:
            content.pop(n, None)
        else:
            content[n] = data
    record = next(n for n in content if n.endswith(".dist-info/RECORD"))
    rows = [f"{p},sha256={_b64(hashlib.sha256(b).digest())},{len(b)}" for p, b in content.items() if p != record]
    content[record] = ("\n".join(rows + [f"{record},,"]) + "\n").encode()
    dst = wheel.with_name(new_name or wheel.name)
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, b in content.items():
            zi = zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            z.writestr(zi, b)
    os.replace(tmp, dst)
    if dst != wheel:
        wheel.unlink()
    return dst


def torch_standin(out: Path, version: str) -> Path:
    """A wheel named torch (``2.14.1+cu130``): enough for pip's resolver and for `which`."""
    local = version.split("+", 1)[1] if "+" in version else ""
    cuda = f"{int(local[2:-1])}.{int(local[-1])}" if local.startswith("cu") else None
    src = f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n".encode()
    return build_wheel(out, "torch", version, files={"torch/__init__.py": src})


class _Quiet(http.server.SimpleHTTPRequestHandler):
    requested: list[str]

    def log_message(self, *a) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self.requested.append(self.path)
        super().do_GET()


class Served(str):
    """The base URL of a served directory; ``.requested`` lists the paths asked for."""

    requested: list[str]


@contextlib.contextmanager
def serve_dir(root: Path):
    """A real HTTP server for a directory on 127.0.0.1; yields its base URL."""
    requested: list[str] = []
    handler = functools.partial(type("H", (_Quiet,), {"requested": requested}), directory=str(root))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    url = Served(f"http://127.0.0.1:{srv.server_address[1]}/")
    url.requested = requested
    try:
        yield url
    finally:
        srv.shutdown()
        srv.server_close()


def pip_env(**extra: str) -> dict[str, str]:
    """An environment where pip sees no user/global config (this machine's pip config adds
    indexes and constraints) and never asks anything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_DEFAULT_TIMEOUT="20", PIP_RETRIES="0", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


class Venv:
    """A fresh virtual environment without pip of its own; the real pip of the test
    interpreter drives it through ``pip --python``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
        self.python = str(path / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))

    def pip(self, *args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """The real pip; ``env`` adds to (or overrides) the clean pip environment, e.g. a
        pip.conf through PIP_CONFIG_FILE, or PIP_EXTRA_INDEX_URL."""
        cmd = [sys.executable, "-m", "pip", "--python", self.python, *args]
        p = subprocess.run(cmd, env=pip_env(**(env or {})), capture_output=True, text=True, timeout=180)
        if check and p.returncode != 0:
            raise AssertionError(f"pip {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}")
        return p

    def installed(self) -> dict[str, str]:
        code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"
        out = subprocess.run([self.python, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
        import json

        return json.loads(out)

    def run(self, code: str) -> str:
        return subprocess.run([self.python, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout.strip()
