"""Bad input gets a one-line error before any work, at the command line (the exit codes of
docs/factory.md: 2 for bad input) and through the nox session that runs it (nox reports any failure as 1,
and its output carries the same message).

The nox runs use this file's noxfile with ``--no-venv --no-install``: the session's own code and
nox's exit status, in this interpreter (which has the factory's requirements), without creating
a session environment per test."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci.toolchain.targets import Matrix
from ci.toolchain.variant import torch_line

REPO = Path(__file__).resolve().parent.parent
TARGET = "linux-x86_64-cu130-torch2.10-stable"
TOKENLESS = {k: v for k, v in os.environ.items() if k not in ("GITHUB_TOKEN", "GH_TOKEN")}


def command(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=env if env is not None else dict(os.environ))


def has_nox() -> bool:
    return subprocess.run([sys.executable, "-c", "import nox"], capture_output=True).returncode == 0


def nox(session: str, *posargs, env=None) -> subprocess.CompletedProcess:
    if not has_nox():
        pytest.skip("needs nox in the test environment (nox -s tests installs it from ci/requirements-nox.txt)")
    return command("-m", "nox", "--no-venv", "--no-install", "-f", str(REPO / "noxfile.py"), "-s", session,
                   "--", *posargs, env=env)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


def in_nox_output(proc: subprocess.CompletedProcess, line: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert line in out and "Traceback" not in out, out
    assert "Session" in out and "failed" in out, out
    assert "uv binary not found" not in out  # nox's look for uv, which the venv backend never uses


def test_verify_python_older_than_the_wheels_requires_python_is_refused_before_building(tmp_path):
    dist = tmp_path / "dist"
    t0 = time.monotonic()
    proc = command("-m", "ci", "build-wheels", "--target", TARGET, "--verify-python", "2.7", "--dist", str(dist))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line_error(proc, "--verify-python 2.7", "Requires-Python", ">=3.10", "pass 3.10 or newer")
    assert time.monotonic() - t0 < 60 and not dist.exists() and "[build]" not in proc.stdout
    in_nox_output(nox("build-wheels", "--target", TARGET, "--verify-python", "2.7", "--dist", str(dist)), line)
    assert not dist.exists()


def test_verify_python_its_torch_has_no_build_for_and_not_a_version(tmp_path):
    proc = command("-m", "ci", "build-wheels", "--target", TARGET, "--verify-python", "3.9", "--dist", str(tmp_path))
    assert proc.returncode == 2
    one_line_error(proc, "--verify-python 3.9", "requires Python >=3.10")
    proc = command("-m", "ci", "build-wheels", "--target", TARGET, "--verify-python", "three", "--dist", str(tmp_path))
    assert proc.returncode == 2
    one_line_error(proc, "--verify-python 'three'", "expected a CPython version X.Y")
    assert not list(tmp_path.iterdir())


def test_a_verify_python_that_cannot_be_had_names_it_and_the_fix(tmp_path):
    """No such interpreter anywhere, and nothing that can provision it (no pyenv; uv, if any,
    offers no download): one line naming the version, what provisioning said, and the fix."""
    bare = tmp_path / "bin"  # a PATH holding `python` (this interpreter, for nox) and nothing else
    bare.mkdir()
    (bare / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bare / "python").chmod(0o755)
    # uv, where this environment has it (ci/requirements-test.txt), offers no download: an empty list
    (tmp_path / "downloads.json").write_text("{}")
    # the newest Python the target's verify torch is published for, other than this one: with
    # this PATH and no pyenv, nothing finds it
    matrix = Matrix.load()
    target = matrix.target(TARGET)
    v = [p for p in matrix.line(torch_line(target.build_torch)).python if p != "%d.%d" % sys.version_info[:2]][-1]
    var = f"SAGEATTN3_PYTHON_{v.replace('.', '_')}"
    env = {**os.environ, "PATH": str(bare), "PYENV_ROOT": str(bare), "SAGEATTN3_CACHE": str(tmp_path / "cache"),
           "UV_PYTHON_DOWNLOADS_JSON_URL": (tmp_path / "downloads.json").as_uri()}
    env.pop(var, None)
    args = ("build-wheels", "--target", TARGET, "--verify-python", v, "--dist", str(tmp_path / "dist"))
    proc = command("-m", "ci", *args, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line_error(proc, f"Python {v} not found", "Provisioning failed: ", f"uv python install {v}", var)
    assert "neither uv nor pyenv is installed" in line or f"`uv python install {v}`: " in line, line
    assert not (tmp_path / "dist").exists()
    in_nox_output(nox(*args, env=env), line)


def test_a_missing_token_is_bad_input(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    (index / "index.json").write_text(json.dumps({"wheels": []}))
    args = ("pages", "--repo", "owner/name", "--index", str(index), "--api-url", "http://127.0.0.1:9/")
    proc = command("-m", "ci.release.publish", *args, env=TOKENLESS)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line_error(proc, "no GitHub token", "GITHUB_TOKEN or GH_TOKEN")
    in_nox_output(nox("pages", *args[1:], env=TOKENLESS), line)


def test_a_python_the_dry_run_cannot_get_is_one_line_before_any_build(tmp_path):
    """The release dry run finds every Python it needs before it builds anything: with none but
    this interpreter reachable (and provisioning off), one line naming the Python and the targets
    that need it, exit 2, and nothing built."""
    here = "%d.%d" % sys.version_info[:2]
    missing = next(t.python for t in Matrix.load().targets if t.python != here)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGEATTN3_PYTHON_")}
    env.update(SAGEATTN3_NO_PROVISION_PYTHON="1", PYENV_ROOT=str(tmp_path / "no-pyenv"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]))
    env.pop("UV_PYTHON_INSTALL_DIR", None)
    proc = command("-m", "ci.release", "--dry-run", "--dist", str(tmp_path / "dist"), env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("release: the dry run needs Python ") and "(for linux-" in line and "Traceback" not in proc.stderr
    assert "[build]" not in proc.stdout and not list((tmp_path / "dist").glob("**/*.whl"))
    assert missing in proc.stderr


def test_an_older_python_running_the_factory_is_told_which_it_needs():
    """The factory needs Python 3.11+ (tomllib): an older one gets one line and exit 2, not an
    ImportError traceback from whichever module imports tomllib first."""
    from ci.toolchain.tools import ToolchainError, find_python

    try:
        old = find_python("3.10", provision=False)
    except ToolchainError as e:
        pytest.skip(f"needs a Python 3.10 to run the factory with: {str(e)[:200]}")
    for args in (["-m", "ci", "build-wheels", "--list-targets"], ["-m", "ci.checks.clean", "--dry-run"]):
        proc = subprocess.run([str(old), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: the sageattn3 factory needs Python 3.11 or newer") and \
            "Traceback" not in proc.stderr and "uvx --python 3.11 nox" in proc.stderr
