"""``python -m ci.toolchain.cpu_torch install`` (what ``nox -s tests`` runs for its torch), with real pip
in a fresh venv against local indexes over HTTP: the +cpu build from pip's index, else from
PyTorch's CPU index, else the plain release with a warning that it is a CUDA build; nothing at
all is exit 2 with what to change."""

import base64
import functools
import hashlib
import http.server
import os
import subprocess
import sys
import threading
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VERSION = "9.9.0"  # a torch no real index has, so only these servers can answer


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    dist = f"{name}-{version}"
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
                 name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)),
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    project = folder / name.replace("_", "-")
    project.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(project / f"{dist}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")


@pytest.fixture
def serve():
    servers = []

    def start(root: Path) -> str:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
        handler.log_message = lambda *a: None
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/"

    yield start
    for srv in servers:
        srv.shutdown()


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    venv.create(root, with_pip=True)
    return root / "bin" / "python"


def install(python: Path, index: str, cpu_index: str) -> subprocess.CompletedProcess:
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torch"], capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHONPATH=str(REPO), PIP_INDEX_URL=index, PIP_RETRIES="0", PIP_TIMEOUT="5")
    return subprocess.run([str(python), "-m", "ci.toolchain.cpu_torch", "install", "--spec", f"torch=={VERSION}+cpu",
                           "--cpu-index", cpu_index], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.skipif(sys.platform == "win32", reason="the venv layout here is POSIX")
def test_cpu_build_first_from_pips_index_then_pytorchs_then_the_plain_release(tmp_path, serve, fresh_python):
    plain = tmp_path / "plain"  # pip's index: only the plain (CUDA) release and its nvidia-* library
    _wheel(plain, "torch", VERSION, ["nvidia-fake-runtime"])
    _wheel(plain, "nvidia_fake_runtime", "1.0", [])
    cpu = tmp_path / "cpu"  # PyTorch's CPU index: the +cpu build
    _wheel(cpu, "torch", f"{VERSION}+cpu", [])
    empty = tmp_path / "empty"
    empty.mkdir()
    plain_url, cpu_url, empty_url = serve(plain), serve(cpu), serve(empty)
    unreachable = "http://127.0.0.1:9/"

    # PyTorch's CPU index has it: the +cpu build, checked.
    got = install(fresh_python, plain_url, cpu_url)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"torch=={VERSION}+cpu from pip's index: not found" in got.stdout
    assert f"CPU build: torch {VERSION}+cpu" in got.stdout and "warning" not in got.stdout

    # PyTorch's CPU index unreachable: the plain release, installed with a warning saying why.
    got = install(fresh_python, plain_url, unreachable)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"warning: torch {VERSION} requires nvidia-fake-runtime: a CUDA build" in got.stdout

    # pip's index has the +cpu build itself (a mirror, a wheel house): taken first.
    got = install(fresh_python, cpu_url, unreachable)
    assert got.returncode == 0 and got.stdout.splitlines()[0].endswith(f"torch=={VERSION}+cpu from pip's index")
    assert f"CPU build: torch {VERSION}+cpu" in got.stdout

    # Nothing anywhere: exit 2 and what to change.
    got = install(fresh_python, empty_url, unreachable)
    assert got.returncode == 2, got.stdout + got.stderr
    assert "error: no torch could be installed" in got.stdout and "PIP_FIND_LINKS" in got.stdout
