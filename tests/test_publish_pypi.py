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

from ci.release.publish.pypi import default_variant_from_matrix, derive_unlabelled
from conftest_publish import REPO, Venv, sage_wheel, torch_standin

pytestmark = pytest.mark.timeout(240)
pytest.importorskip("pypiserver")
passlib_apache = pytest.importorskip("passlib.apache")

USER, PASSWORD = "uploader", "pw-" + os.urandom(12).hex()
VARIANTS = ("cu132.torch2.10.stable", "cu128.torch2.8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_pypiserver(tmp_path: Path, auth: bool):
    pkgs = tmp_path / "packages"
    pkgs.mkdir()
    if auth:
        ht = passlib_apache.HtpasswdFile(str(tmp_path / "htpasswd"), new=True)
        ht.set_password(USER, PASSWORD)
        ht.save()
        auth_args = ["-P", str(tmp_path / "htpasswd"), "-a", "update"]
    else:
        auth_args = ["-P", ".", "-a", "."]  # no authentication at all
    port = _free_port()
    log = open(tmp_path / "pypiserver.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pypiserver", "run", "-i", "127.0.0.1", "-p", str(port),
                             *auth_args, "--backend", "simple-dir", str(pkgs)],
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, log, pkgs, port


@pytest.fixture
def pypiserver(tmp_path):
    yield from _serve(tmp_path, auth=True)


@pytest.fixture
def open_pypiserver(tmp_path):
    yield from _serve(tmp_path, auth=False)


def _serve(tmp_path: Path, auth: bool):
    proc, log, pkgs, port = _start_pypiserver(tmp_path, auth)
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


def upload(url: str, wheels: Path, *extra: str, password: str | None = PASSWORD, tmp: Path | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TWINE_")}, **(env or {})}
    if password is not None:
        env.update(TWINE_USERNAME=USER, TWINE_PASSWORD=password)
    cmd = [sys.executable, "-m", "ci.release.publish", "pypi", "--repository-url", url, "--wheels", str(wheels), *extra]
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
    venv.pip("install", "--no-index", str(torch_standin(tmp_path / "t", "2.15.0+cu132")))
    venv.pip("install", "sageattn3==1.0.0+cu132.torch2.10.stable", "--index-url", url + "simple/")
    got = venv.installed()
    assert got["sageattn3"] == "1.0.0+cu132.torch2.10.stable" and got["torch"] == "2.15.0+cu132"


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
    venv.pip("install", "--no-index", str(torch_standin(tmp_path / "t", "2.15.0+cu132")))
    venv.pip("install", "sageattn3", "--index-url", url + "simple/")
    assert venv.installed()["sageattn3"] == "1.0.0"
    assert venv.run("import sageattn3; print(sageattn3.VARIANT)") == "cu132.torch2.10.stable"
    assert venv.installed()["torch"] == "2.15.0+cu132"


def test_default_variant_and_derived_wheel_are_valid(wheels, tmp_path):
    assert default_variant_from_matrix() == "cu132.torch2.10.stable"
    src = next(wheels.glob("*cu132*.whl"))
    out = derive_unlabelled(src, tmp_path / "o")
    assert out.name == src.name.replace("+cu132.torch2.10.stable", "")
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


def test_upload_to_a_server_without_authentication_needs_no_credentials_and_prints_no_colours(open_pypiserver, wheels):
    url, pkgs = open_pypiserver
    # a terminal that asks for colours: twine's output must still reach the log without escape codes
    p = upload(url, wheels, "--all-variants", password=None, env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(x.name for x in pkgs.iterdir()) == sorted(w.name for w in wheels.glob("*.whl"))
    assert "without credentials" in p.stdout and "twine: " in p.stdout
    assert "\x1b" not in p.stdout + p.stderr and "Credential not found" not in p.stdout + p.stderr


def test_credentials_refused_by_a_server_say_which_variables_to_set(pypiserver, wheels):
    url, pkgs = pypiserver
    p = upload(url, wheels, "--all-variants", password=None)
    assert p.returncode == 1 and "TWINE_USERNAME and TWINE_PASSWORD" in p.stderr, p.stdout + p.stderr
    assert not list(pkgs.iterdir())


@pytest.mark.parametrize("args,needle", [
    (["--repository-url", "notaurl"], "not an http(s) URL"),
    (["--repository-url", "http://127.0.0.1:9/", "--wheels", "/nonexistent-wheels-dir"], "no such directory"),
    (["--repository-url", "http://127.0.0.1:9/", "--pypi", "--default-variant", "cu130"], "--default-variant"),
])
def test_bad_input_is_refused_with_exit_2(wheels, args, needle):
    args = list(args)
    if "--wheels" not in args:
        args += ["--wheels", str(wheels)]
    p = subprocess.run([sys.executable, "-m", "ci.release.publish", "pypi", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_module_docstring_names_the_default_variant_the_code_picks():
    import ci.release.publish.pypi as pypi

    assert f"with this commit's matrix\n  ``{default_variant_from_matrix()}``" in pypi.__doc__
