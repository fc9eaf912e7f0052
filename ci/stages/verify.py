"""The verify stage: install each wheel the way a user would and check what happened.

For each Python: a fresh venv that already has the target's torch (the torch of a cached
environment made visible through a ``.pth`` file, so pip sees it as installed), then
``pip install sageattn3==<version> --index-url http://127.0.0.1:<port>/<variant page>/``
against the index served by a real HTTP server, with pip's own config files disabled so
nothing but that index can satisfy anything. Then: the wheel pip picked is this one, torch's
version and files are unchanged, ``import sageattn3`` works without a GPU and reports this
build record. The ABI guard: the same wheel imported into a torch it was not built for
must fail with an ImportError naming both sides and the right install command.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ci.runtime.log import default_log
from ci.stages.record import BuildRecord
from ci.runtime.pip_env import pip_environ
from ci.toolchain.resolved import TorchEnv, VerifyEnvs, venv_python
from ci.toolchain.variant import cuda_tag, torch_line
from ci.runtime.errors import FactoryError


class VerifyError(FactoryError, RuntimeError):
    pass


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep build logs readable
        pass


@contextlib.contextmanager
def serve(directory: Path):
    """A real HTTP server for ``directory`` on 127.0.0.1; yields its base URL."""
    with serve_handler(functools.partial(_QuietHandler, directory=str(directory))) as url:
        yield url


@contextlib.contextmanager
def serve_handler(handler):
    """A real threading HTTP server with ``handler`` on 127.0.0.1 (a free port); yields its base
    URL and shuts it down afterwards."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def make_venv_with(base: TorchEnv, where: Path) -> Path:
    """A fresh venv that sees ``base``'s torch as installed; returns its python."""
    py = base.python.resolve()
    # The venv's interpreter must be the same Python as the base env's.
    real = subprocess.run([str(base.python), "-c", "import sys; print(sys._base_executable)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([real or str(py), "-m", "venv", str(where)], check=True, env=pip_environ(sources=False))
    vpy = venv_python(where)
    site = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_base_torch.pth").write_text(str(base.site_packages) + "\n")
    # ensurepip's old setuptools would shadow the one torch requires from the base env.
    subprocess.run([str(vpy), "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"],
                   capture_output=True, env=pip_environ(sources=False))
    return vpy


_SNAPSHOT = r"""
import json, hashlib, pathlib, importlib.metadata as md
d = md.distribution("torch")
rec = pathlib.Path(d._path, "RECORD")
print(json.dumps({"version": d.version, "location": str(pathlib.Path(d._path).parent),
                  "record_sha256": hashlib.sha256(rec.read_bytes()).hexdigest()}))
"""


def torch_snapshot(python: Path) -> dict:
    out = subprocess.run([str(python), "-c", _SNAPSHOT], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@dataclass
class VerifyReport:
    wheel: str
    pythons: list[str] = field(default_factory=list)
    abi_guard: str = "not run"
    notes: list[str] = field(default_factory=list)


def _variant_page(rec: BuildRecord, torch_version: str) -> str:
    return f"{cuda_tag(rec.cuda)}/torch{torch_line(torch_version)}/"


def install_and_check(rec: BuildRecord, base: TorchEnv, index_url: str, work: Path, log=default_log) -> None:
    vpy = make_venv_with(base, work)
    before = torch_snapshot(vpy)
    page = _variant_page(rec, base.torch_version)
    cmd = [str(vpy), "-m", "pip", "install", "--no-cache-dir", f"sageattn3=={rec.version}",
           "--index-url", f"{index_url}/{page}"]
    log(f"[verify] py{base.python_version}: {' '.join(cmd[1:])}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_environ(sources=False))
    if proc.returncode != 0:
        raise VerifyError(f"{rec.wheel}: pip could not install it from {index_url}/{page}:\n{proc.stdout}{proc.stderr}")
    installed = [ln for ln in proc.stdout.splitlines() if ln.startswith("Successfully installed")]
    if any(w.startswith("torch-") for ln in installed for w in ln.split()):
        raise VerifyError(f"{rec.wheel}: pip installed torch while installing sageattn3: {installed}")
    after = torch_snapshot(vpy)
    if after != before:
        raise VerifyError(f"{rec.wheel}: installing it changed torch: before {before}, after {after}")
    probe = (
        "import json, importlib.metadata as md, sageattn3;"
        "print(json.dumps({'dist': md.version('sageattn3'), 'record': sageattn3.build_info(),"
        " 'file': md.distribution('sageattn3').read_text('RECORD') is not None}))"
    )
    # the caller's PYTHONPATH would let another sageattn3 or torch answer the import
    res = subprocess.run([str(vpy), "-c", probe], capture_output=True, text=True,
                         env=pip_environ(extra={"CUDA_VISIBLE_DEVICES": ""}))
    if res.returncode != 0:
        raise VerifyError(f"{rec.wheel}: `import sageattn3` failed in Python {base.python_version} without a GPU:\n{res.stderr}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if got["dist"] != rec.version:
        raise VerifyError(f"{rec.wheel}: pip picked sageattn3 {got['dist']}, not {rec.version}")
    if got["record"].get("variant") != rec.variant or got["record"].get("target") != rec.target:
        raise VerifyError(f"{rec.wheel}: the installed build record says {got['record']}, expected {rec.target}")


def check_abi_guard(rec: BuildRecord, foreign: TorchEnv, index_url: str, work: Path, log=default_log) -> str:
    """Import into a torch the wheel was not built for: must be a clear ImportError."""
    vpy = make_venv_with(foreign, work)
    page = f"{cuda_tag(rec.cuda)}/"
    cmd = [str(vpy), "-m", "pip", "install", "--no-cache-dir", "--no-deps", f"sageattn3=={rec.version}",
           "--index-url", f"{index_url}/{page}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_environ(sources=False))
    if proc.returncode != 0:
        raise VerifyError(f"{rec.wheel}: could not install into the foreign-torch venv:\n{proc.stderr}")
    res = subprocess.run([str(vpy), "-c", "import sageattn3"], capture_output=True, text=True, env=pip_environ())
    msg = res.stderr
    if res.returncode == 0:
        raise VerifyError(f"{rec.wheel}: imported into torch {foreign.torch_version} without the ABI guard firing")
    want = [rec.variant, foreign.torch_version, "pip install", "TorchMismatchError"]
    missing = [w for w in want if w not in msg]
    if missing or "undefined symbol" in msg:
        raise VerifyError(f"{rec.wheel}: the ABI guard's message lacks {missing}:\n{msg}")
    line = [ln for ln in msg.splitlines() if ln.startswith("sageattn3._guard.TorchMismatchError")]
    log(f"[verify] ABI guard with torch {foreign.torch_version}: {line[-1][:200] if line else msg[-200:]}")
    return f"torch {foreign.torch_version}: ImportError as expected"


class NoCpuTorch(VerifyError):
    """No CPU build of torch is reachable here (PyTorch's CPU index unreachable, pip's index
    without one): the ABI-guard check cannot run, and the verify report says so."""


def verify(rec: BuildRecord, index_dir: Path, envs: VerifyEnvs, log=default_log) -> VerifyReport:
    """Install ``rec``'s wheel from ``index_dir`` (served over HTTP) into a fresh venv over each
    of ``envs.bases`` and check it; then the ABI guard in ``envs.foreign`` (the environments
    resolved beforehand: ci.stages.resolve.verify_envs)."""
    report = VerifyReport(rec.wheel)
    with serve(index_dir) as url, tempfile.TemporaryDirectory(prefix="sageattn3-verify-") as tmp:
        for py, base in envs.bases:
            log(f"[verify] py{py}: torch {base.torch_version} ({envs.source})")
            install_and_check(rec, base, url, Path(tmp) / f"venv-{py}", log=log)
            report.pythons.append(py)
        if envs.foreign_unchecked:
            # The wheel is verified; what could not be checked is said in the summary line.
            report.abi_guard = f"NOT CHECKED: {envs.foreign_unchecked}"
            log(f"[verify] ABI guard NOT CHECKED: {envs.foreign_unchecked}")
            return report
        if envs.foreign is not None:
            foreign = envs.foreign
            if rec.variant_value.serves(foreign.torch_version, foreign.torch_cuda):
                report.abi_guard = f"skipped: {foreign.torch_version} is served by {rec.variant}"
                return report
            report.abi_guard = check_abi_guard(rec, foreign, url, Path(tmp) / "venv-foreign", log=log)
    return report
