"""The rehearsal's stand-in for PyTorch's index: a real HTTP server on 127.0.0.1 laid out
like ``download.pytorch.org/whl``, serving PyPI's torch wheels (kept in the factory's cache)
under the CUDA directory each belongs in.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from ci.runtime.log import default_log
from ci.runtime.pip_env import pip_environ
from ci.release import ReleaseError
from ci.toolchain.targets import Matrix


PYPI_SIMPLE = "https://pypi.org/simple"


def standin_dir(version: str, matrix: Matrix) -> str:
    """The PyTorch index directory PyPI's x86_64 ``torch==version`` belongs in: PyPI ships one
    CUDA variant per release (the line's ``pypi_default``: cu128 for 2.8-2.10, cu130 from 2.11)."""
    from ci.toolchain.variant import cuda_tag, torch_line

    return cuda_tag(matrix.line(torch_line(version)).pypi_default)


def standin_wheels() -> Path:
    from ci.toolchain.tools import cache_root

    return cache_root() / "torch-index"


def fetch_torch(version: str, python: str, matrix: Matrix, *, platform: str = "manylinux_2_28_x86_64",
                log=default_log) -> Path:
    """PyPI's x86_64 wheel of ``torch==version`` for ``python`` into the factory cache, under
    the PyTorch index directory it is a build of (``torch-index/cu128/...``)."""
    dest = standin_wheels() / standin_dir(version, matrix)
    tag = "cp" + python.replace(".", "")
    have = sorted(dest.glob(f"torch-{version}-{tag}-{tag}-*{platform.split('_', 3)[-1]}.whl")) if dest.is_dir() else []
    if have:
        return have[0]
    dest.mkdir(parents=True, exist_ok=True)
    log(f"[stand-in] downloading torch {version} ({tag}, {platform}) from PyPI into {dest}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"torch=={version}",
           "--python-version", python, "--platform", platform, "--index-url", PYPI_SIMPLE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_environ(sources=False))
    got = sorted(dest.glob(f"torch-{version}-{tag}-*.whl"))
    if proc.returncode != 0 or not got:
        raise ReleaseError(f"could not download torch {version} for Python {python} from PyPI:\n{proc.stderr[-2000:]}")
    return got[0]


class _StandInHandler(BaseHTTPRequestHandler):
    """``/whl/<dir>/torch/``: a PEP 503 page of the wheels in ``<root>/<dir>``, each with its
    core metadata (PEP 658/714, so that resolving torch needs no 1 GB download); the wheels
    and ``<wheel>.metadata`` themselves; ``/whl/<dir>/<other>/``: 302 to PyPI's page (torch's
    dependencies, which PyTorch's index mirrors from PyPI)."""

    root: Path

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes = b"", ctype: str = "text/html", headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        from urllib.parse import unquote, urlsplit

        parts = [p for p in unquote(urlsplit(self.path).path).split("/") if p]
        if len(parts) < 2 or parts[0] != "whl" or not re.fullmatch(r"cpu|cu\d{3,4}", parts[1]):
            return self._send(404, b"not a PyTorch index path")
        folder = self.root / parts[1]
        if len(parts) == 2:
            return self._send(200, b'<!DOCTYPE html><html><body><a href="torch/">torch</a></body></html>')
        project = re.sub(r"[-_.]+", "-", parts[2]).lower()
        if project != "torch":
            if len(parts) == 3:
                return self._send(302, headers={"Location": f"{PYPI_SIMPLE}/{project}/"})
            return self._send(404)
        if len(parts) == 3:
            anchors = []
            for w in sorted(folder.glob("torch-*.whl")):
                meta = "sha256=" + hashlib.sha256(_wheel_metadata(w)).hexdigest()
                anchors.append(f'<a href="{w.name.replace("+", "%2B")}#sha256={_sha256_cached(w)}" '
                               f'data-dist-info-metadata="{meta}" data-core-metadata="{meta}">{w.name}</a><br>')
            return self._send(200, f"<!DOCTYPE html><html><body>{''.join(anchors)}</body></html>".encode())
        if len(parts) == 4 and parts[3].endswith(".whl.metadata"):
            wheel = folder / parts[3].removesuffix(".metadata")
            if wheel.is_file() and wheel.parent == folder:
                return self._send(200, _wheel_metadata(wheel), ctype="application/octet-stream")
            return self._send(404)
        wheel = folder / parts[3]
        if len(parts) == 4 and wheel.is_file() and wheel.parent == folder:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(wheel.stat().st_size))
            self.end_headers()
            if self.command != "HEAD":
                with open(wheel, "rb") as f:
                    shutil.copyfileobj(f, self.wfile, 1 << 20)
            return None
        return self._send(404)


def _wheel_metadata(wheel: Path) -> bytes:
    """A wheel's ``.dist-info/METADATA`` (what PEP 658 serves as ``<wheel>.metadata``), kept
    beside the wheel once read."""
    memo = wheel.with_name(wheel.name + ".metadata")
    if memo.exists() and memo.stat().st_mtime_ns >= wheel.stat().st_mtime_ns:
        return memo.read_bytes()
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ReleaseError(f"{wheel.name}: {len(names)} .dist-info/METADATA files")
        data = z.read(names[0])
    memo.write_bytes(data)
    return data


def _sha256_cached(path: Path) -> str:
    """A wheel's sha256, remembered beside it (torch wheels are ~1 GB)."""
    memo = path.with_name(path.name + ".sha256")
    st = path.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    if memo.exists():
        stored_stamp, _, digest = memo.read_text().partition(" ")
        if stored_stamp == stamp:
            return digest.strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    memo.write_text(f"{stamp} {h.hexdigest()}")
    return h.hexdigest()


@contextlib.contextmanager
def pytorch_index_standin(root: Path | None = None):
    """A real HTTP server on 127.0.0.1 laid out like PyTorch's index; yields its ``/whl`` URL
    (what ``SAGEATTN3_PYTORCH_INDEX`` points at in the rehearsal)."""
    from ci.stages.verify import serve_handler

    handler = type("StandIn", (_StandInHandler,), {"root": Path(root or standin_wheels())})
    with serve_handler(handler) as url:
        yield f"{url}/whl"


def standin_serves(target, matrix: Matrix) -> str | None:
    """Why the stand-in cannot serve this target's torch (None: it can). It serves what PyPI
    has: Linux x86_64 CUDA builds, one CUDA variant per torch release."""
    if target.os.key != "linux-x86_64":
        return f"PyPI has no CUDA torch for {target.os.key} (PyTorch's index only)"
    pypi = standin_dir(target.build_torch, matrix)
    if pypi != target.variant.cuda_tag:
        return (f"PyPI's torch {target.build_torch} is the {pypi} build, the target needs "
                f"{target.variant.cuda_tag} (PyTorch's index only)")
    return None



def standin_needs(matrix: Matrix, build: list[str] = ()) -> list[tuple[str, str]]:
    """The (torch version, Python) wheels the stand-in must hold for a rehearsal that builds
    the targets ``build`` and resolves every other served target."""
    from ci.toolchain.torch_source import foreign_line

    chosen = [t for t in matrix.targets if t.id in build or standin_serves(t, matrix) is None]
    return sorted({(v, t.python) for t in chosen for v in (t.build_torch, foreign_line(t, matrix, t.python))})


