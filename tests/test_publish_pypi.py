"""twine -> a real pypiserver on loopback (started here), then real pip installs from it;
the PyPI mode's unlabelled default variant."""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from ci.publish.pypi import default_variant_from_matrix, derive_unlabelled
from conftest_publish import REPO, Venv, sage_wheel, torch_standin

pytestmark = pytest.mark.timeout(240)
pytest.importorskip("pypiserver")
passlib_apache = pytest.importorskip("passlib.apache")

USER, PASSWORD = "uploader", "pw-" + os.urandom(12).hex()
VARIANTS = ("cu130.torch2.10.stable", "cu128.torch2.8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pypiserver(tmp_path):
    pkgs = tmp_path / "packages"
    pkgs.mkdir()
    ht = passlib_apache.HtpasswdFile(str(tmp_path / "htpasswd"), new=True)
    ht.set_password(USER, PASSWORD)
    ht.save()
    port = _free_port()
    log = open(tmp_path / "pypiserver.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pypiserver", "run", "-i", "127.0.0.1", "-p", str(port),
                             "-P", str(tmp_path / "htpasswd"), "-a", "update", "--backend", "simple-dir", str(pkgs)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "simple/", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("pypiserver did not start: " + (tmp_path / "pypiserver.log").read_text())
            time.sleep(0.2)
    try:
        yield url, pkgs
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    for v in VARIANTS:
        sage_wheel(d, v)
    return d


def upload(url: str, wheels: Path, *extra: str, password: str = PASSWORD, tmp: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TWINE_USERNAME": USER, "TWINE_PASSWORD": password}
    cmd = [sys.executable, "-m", "ci.publish", "pypi", "--repository-url", url, "--wheels", str(wheels), *extra]
    if tmp is not None:
        cmd += ["--out", str(tmp / "pypi")]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def test_all_variants_upload_skip_existing_and_pip_install(pypiserver, wheels, tmp_path):
    url, pkgs = pypiserver
    p = upload(url, wheels, "--all-variants")
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(x.name for x in pkgs.iterdir()) == sorted(w.name for w in wheels.glob("*.whl"))
    p = upload(url, wheels, "--all-variants")  # again: skip-existing, nothing changes
    assert p.returncode == 0 and "uploaded 0, skipped 2" in p.stdout, p.stdout + p.stderr
    # pip from the server, torch preinstalled and left alone
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--no-index", str(torch_standin(tmp_path / "t", "2.14.1+cu130")))
    venv.pip("install", "sageattn3==1.0.0+cu130.torch2.10.stable", "--index-url", url + "simple/")
    got = venv.installed()
    assert got["sageattn3"] == "1.0.0+cu130.torch2.10.stable" and got["torch"] == "2.14.1+cu130"


def test_bad_credentials_fail_without_echoing_them(pypiserver, wheels):
    url, pkgs = pypiserver
    wrong = "pw-" + os.urandom(12).hex()
    p = upload(url, wheels, "--all-variants", password=wrong)
    assert p.returncode == 1 and "twine upload" in p.stderr
    assert wrong not in p.stdout + p.stderr and not list(pkgs.iterdir())


def test_pypi_mode_uploads_only_the_unlabelled_default(pypiserver, wheels, tmp_path):
    url, pkgs = pypiserver
    p = upload(url, wheels, "--pypi", tmp=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PyPI refuses local version labels" in p.stdout and "cu128.torch2.8" in p.stdout  # says what it left out
    names = sorted(x.name for x in pkgs.iterdir())
    assert len(names) == 1 and names[0].startswith("sageattn3-1.0.0-cp310-abi3-")
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--no-index", str(torch_standin(tmp_path / "t", "2.14.1+cu130")))
    venv.pip("install", "sageattn3", "--index-url", url + "simple/")
    assert venv.installed()["sageattn3"] == "1.0.0"
    assert venv.run("import sageattn3; print(sageattn3.VARIANT)") == "cu130.torch2.10.stable"
    assert venv.installed()["torch"] == "2.14.1+cu130"


def test_default_variant_and_derived_wheel_are_valid(wheels, tmp_path):
    assert default_variant_from_matrix() == "cu130.torch2.10.stable"
    src = next(wheels.glob("*cu130*.whl"))
    out = derive_unlabelled(src, tmp_path / "o")
    assert out.name == src.name.replace("+cu130.torch2.10.stable", "")
    again = derive_unlabelled(src, tmp_path / "o2")
    assert out.read_bytes() == again.read_bytes()  # deterministic
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        assert "sageattn3-1.0.0.dist-info/METADATA" in names and not any("+" in n for n in names)
        assert b"Version: 1.0.0\n" in z.read("sageattn3-1.0.0.dist-info/METADATA")
        for row in z.read("sageattn3-1.0.0.dist-info/RECORD").decode().splitlines():
            path, h, size = row.rsplit(",", 2)
            if h:
                data = z.read(path)
                assert h == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert int(size) == len(data)
