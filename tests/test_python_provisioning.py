"""A Python the factory cannot find is provisioned: real uv (`uv python install`) downloads a
python-build-standalone-style archive from a real HTTP server on 127.0.0.1 (its download list
given by UV_PYTHON_DOWNLOADS_JSON_URL, as a mirror would be), checks its sha256, installs it into
the factory's cache, and find_python returns that interpreter; a download that does not check
out is a one-line error naming the version and the fix.

The archive is made here from another CPython of this machine (its interpreter, libpython and
standard library, laid out like python-build-standalone's install_only archives)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ci.toolchain.tools import ToolchainError, find_python
from ci.stages.verify import serve

HERE_PY = "%d.%d" % sys.version_info[:2]


def uv_exe() -> str | None:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def another_python() -> tuple[str, Path] | None:
    for v in ("3.10", "3.12", "3.13", "3.11"):
        if v == HERE_PY:
            continue
        try:
            return v, find_python(v, provision=False)
        except ToolchainError:
            continue
    return None


def install_only_archive(python: Path, version: str, out: Path) -> Path:
    """python/bin/pythonX.Y (+ python3, python), python/lib/libpython*, python/lib/pythonX.Y."""
    prefix = Path(subprocess.run([str(python), "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                                 text=True, check=True).stdout.strip())
    skip = {"test", "site-packages", "__pycache__", "idlelib", "tkinter", "lib2to3", "ensurepip", "turtledemo"}
    archive = out / f"cpython-{version}.99+20990101-x86_64-unknown-linux-gnu-install_only.tar.gz"

    def keep(info: tarfile.TarInfo):
        return None if set(Path(info.name).parts) & skip else info

    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(prefix / "bin" / f"python{version}", f"python/bin/python{version}")
        for link in ("python3", "python"):
            info = tarfile.TarInfo(f"python/bin/{link}")
            info.type, info.linkname = tarfile.SYMTYPE, f"python{version}"
            tar.addfile(info)
        for lib in (prefix / "lib").glob("libpython*"):
            tar.add(lib, f"python/lib/{lib.name}")
        tar.add(prefix / "lib" / f"python{version}", f"python/lib/python{version}", filter=keep)
    return archive


def downloads_json(path: Path, version: str, url: str, sha256: str) -> str:
    major, minor = map(int, version.split("."))
    entry = {"name": "cpython", "arch": {"family": "x86_64", "variant": None}, "os": "linux", "libc": "gnu",
             "major": major, "minor": minor, "patch": 99, "prerelease": "", "url": url, "sha256": sha256,
             "variant": None, "build": "20990101"}
    path.write_text(json.dumps({f"cpython-{version}.99-linux-x86_64-gnu": entry}))
    return path.as_uri()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    uv = uv_exe()
    if not uv:
        pytest.skip("needs uv (ci/requirements-test.txt installs it)")
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the archive is made for linux x86_64")
    other = another_python()
    if not other:
        pytest.skip(f"needs a second CPython beside {HERE_PY} to make the archive from")
    version, python = other
    www = tmp_path_factory.mktemp("www")
    archive = install_only_archive(python, version, www)
    with serve(www) as url:
        yield uv, version, f"{url}/{archive.name}", hashlib.sha256(archive.read_bytes()).hexdigest()


@pytest.fixture
def bare(tmp_path, monkeypatch, served):
    """Nothing to find: an empty pyenv, a PATH with uv alone, an empty factory cache."""
    uv = served[0]
    path = tmp_path / "bin"
    path.mkdir()
    (path / "uv").symlink_to(uv)
    monkeypatch.setenv("PATH", str(path))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    monkeypatch.setenv("SAGEATTN3_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SAGEATTN3_NO_PROVISION_PYTHON", raising=False)
    for v in ("3.10", "3.11", "3.12", "3.13"):
        monkeypatch.delenv(f"SAGEATTN3_PYTHON_{v.replace('.', '_')}", raising=False)
    return tmp_path


def test_a_missing_python_is_installed_with_uv_into_the_cache(bare, served, monkeypatch):
    _, version, url, sha = served
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS_JSON_URL", downloads_json(bare / "dl.json", version, url, sha))
    said = []
    with pytest.raises(ToolchainError, match=rf"Python {version} not found"):
        find_python(version, provision=False)
    exe = find_python(version, log=said.append)
    assert exe.is_relative_to(bare / "cache" / "pythons"), exe
    out = subprocess.run([str(exe), "-c", "import sys, ssl; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == version, out.stderr
    assert said[0].startswith(f"[python] Python {version} not found: `uv python install {version}`")
    assert [p.name for p in (bare / "bin").iterdir()] == ["uv"]  # nothing put on PATH
    said.clear()
    assert find_python(version, log=said.append) == exe and not said  # found now, not installed again


def test_a_download_that_does_not_check_out_is_one_line_naming_the_fix(bare, served, monkeypatch):
    _, version, url, _ = served
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS_JSON_URL", downloads_json(bare / "dl.json", version, url, "0" * 64))
    with pytest.raises(ToolchainError) as e:
        find_python(version, log=lambda m: None)
    msg = str(e.value)
    assert "\n" not in msg and f"Provisioning failed: `uv python install {version}`:" in msg, msg
    assert f"SAGEATTN3_PYTHON_{version.replace('.', '_')}" in msg 
    assert not list((bare / "cache" / "pythons").glob("cpython-*"))


def test_a_failed_provisioning_keeps_uvs_cause_and_does_not_offer_it_again(monkeypatch, tmp_path):
    """What uv prints when python-build-standalone is unreachable: the error line and its last
    cause reach the message; the fix offered is another way than the one that failed."""
    from ci.toolchain.tools import pythons as toolchain

    uv_said = ("error: Failed to install cpython-3.9.25-linux-x86_64-gnu\n"
               "  Caused by: Failed to download https://github.com/astral-sh/python-build-standalone/...\n"
               "  Caused by: Request failed after 3 retries\n"
               "  Caused by: dns error: failed to lookup address information: Name or service not known\n")
    assert toolchain._one_line(uv_said) == ("error: Failed to install cpython-3.9.25-linux-x86_64-gnu (Caused by: dns "
                                           "error: failed to lookup address information: Name or service not known)")
    monkeypatch.setattr(toolchain, "_search_python", lambda version, windows: None)
    monkeypatch.setattr(toolchain, "provision_python", lambda version, log=print: (None, [
        f"`uv python install {version}`: {toolchain._one_line(uv_said)}"]))
    monkeypatch.delenv("SAGEATTN3_NO_PROVISION_PYTHON", raising=False)
    with pytest.raises(ToolchainError) as e:
        find_python("3.1", windows=False)
    msg = str(e.value)
    assert "dns error" in msg and "Install Python 3.1 another way" in msg
    assert msg.count("uv python install 3.1") == 1  # named as what failed, not offered as the fix
