"""What the factory leaves behind and says: the sccache server a build started is stopped, the
caches are cleared by one command, the tests' torch is checked to be a CPU build, and the test
run ends with its skips counted by reason."""

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci.checks.clean import clean
from ci.toolchain.cpu_torch import cpu_build_problem
from ci.toolchain.tools import compiler_launcher, sccache_env, sccache_server_running, sccache_server_scope

REPO = Path(__file__).resolve().parent.parent


def run(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def own_sccache(tmp_path, monkeypatch):
    """A cache dir of this test's own, so the sccache server (its port derives from the dir)
    is nobody else's."""
    if not compiler_launcher():
        pytest.skip("needs sccache (ci/requirements.txt installs it)")
    monkeypatch.setenv("SCCACHE_DIR", str(tmp_path / "sccache"))
    env = sccache_env()
    yield compiler_launcher()[0], env
    subprocess.run([compiler_launcher()[0], "--stop-server"], capture_output=True, env={**os.environ, **env})


def _start(exe, env):
    subprocess.run([exe, "--start-server"], check=True, capture_output=True, env={**os.environ, **env})
    for _ in range(50):
        if sccache_server_running(env):
            return
        time.sleep(0.1)
    raise AssertionError("sccache --start-server started nothing on its port")


def test_a_server_the_build_started_is_stopped_one_already_running_is_left(own_sccache):
    exe, env = own_sccache
    said = []
    assert not sccache_server_running(env)
    with sccache_server_scope(log=said.append):
        _start(exe, env)  # what the first compile through sccache does
        assert sccache_server_running(env)
    assert not sccache_server_running(env) and "stopped the sccache server" in said[0]
    _start(exe, env)  # someone else's, running before the build
    with sccache_server_scope(log=said.append):
        pass
    assert sccache_server_running(env) and len(said) == 1


def test_clean_removes_the_caches_and_says_how_much(tmp_path):
    cache, build = tmp_path / "cache", tmp_path / "build"
    (cache / "envs" / "e").mkdir(parents=True)
    (cache / "envs" / "e" / "blob").write_bytes(b"x" * 3_000_000)
    build.mkdir()
    (build / "obj").write_bytes(b"y" * 1_000_000)
    said = []
    assert clean([cache, build, tmp_path / "absent"], dry_run=True, log=said.append) == 4_000_000
    assert cache.exists() and said[-1] == "would free 0.00 GB" and "would remove" in said[0]
    assert clean([cache, build], log=said.append) == 4_000_000
    assert not cache.exists() and not build.exists()


def test_clean_dry_run_through_nox_names_the_factory_cache(tmp_path):
    if run("-c", "import nox").returncode != 0:
        pytest.skip("needs nox in the test environment (nox -s tests installs it)")
    from ci.toolchain.tools import CACHE_MARKER

    (tmp_path / "cache" / "x").mkdir(parents=True)
    (tmp_path / "cache" / CACHE_MARKER).write_text("")
    proc = run("-m", "nox", "--no-venv", "-f", str(REPO / "noxfile.py"), "-s", "clean", "--", "--dry-run",
               env={"SAGEATTN3_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"would remove {tmp_path / 'cache'} (0.00 GB)" in proc.stdout + proc.stderr
    assert (tmp_path / "cache" / "x").exists() and (REPO / "noxfile.py").exists()


def test_clean_refuses_a_cache_folder_the_factory_did_not_make(tmp_path):
    """SAGEATTN3_CACHE=~/.cache by mistake must not wipe the user's other caches."""
    from ci.checks.clean.__main__ import main as clean_main

    mine = tmp_path / "not-the-factory"
    (mine / "other-tool").mkdir(parents=True)
    import os

    old = os.environ.get("SAGEATTN3_CACHE")
    os.environ["SAGEATTN3_CACHE"] = str(mine)
    try:
        assert clean_main(["--dry-run"]) == 2
    finally:
        if old is None:
            del os.environ["SAGEATTN3_CACHE"]
        else:
            os.environ["SAGEATTN3_CACHE"] = old
    assert (mine / "other-tool").exists()


def _dist(tmp_path: Path, requires: list[str], size: int) -> md.Distribution:
    info = tmp_path / "torch-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "RECORD").write_text(f"torch/lib/libtorch_cuda.so,,{size}\ntorch-9.9.dist-info/METADATA,,\n")
    return md.PathDistribution(info)


def test_a_cuda_build_of_torch_is_told_from_a_cpu_build(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cuda = _dist(tmp_path / "a", ["filelock", 'nvidia-cublas==13.1.0.3; platform_system == "Linux"'], 500_000_000)
    assert "requires nvidia-cublas: a CUDA build" in cpu_build_problem(cuda)
    big = _dist(tmp_path / "b", ["filelock"], 3_000_000_000)
    assert "installs 3.0 GB" in cpu_build_problem(big)


def test_the_tests_torch_is_a_cpu_build():
    try:
        md.distribution("torch")
    except md.PackageNotFoundError:
        pytest.skip("no torch in this environment (nox -s tests installs the CPU build)")
    proc = run("-m", "ci.toolchain.cpu_torch", "check")
    assert proc.returncode == 0 and proc.stdout.startswith("CPU build: torch 2.13.0+cpu"), proc.stdout + proc.stderr


def test_the_run_ends_with_skips_counted_by_reason(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_gpu(i):\n    pytest.skip('no CUDA device')\n"
        "def test_other():\n    pytest.skip('run the dry run first')\n"
        "def test_runs():\n    pass\n")
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    tail = proc.stdout.split("4 skipped, by reason", 1)[1]
    assert tail.splitlines()[1:3] == ["    3  no CUDA device", "    1  run the dry run first"], proc.stdout


def test_nox_sessions_do_not_say_uv_binary_not_found(tmp_path):
    """nox looks for uv on every session that makes an environment and logs when it finds none
    (UV names a uv that is not there: a machine without uv); the venv backend never uses it."""
    if run("-c", "import nox").returncode != 0:
        pytest.skip("needs nox in the test environment (nox -s tests installs it)")
    env = {"UV": str(tmp_path / "no-uv-here")}
    args = ("-m", "nox", "--envdir", str(tmp_path / "envs"), "-s", "matrix")
    proc = run(*args, "-f", str(REPO / "noxfile.py"), "--", "--compact", env=env)
    assert proc.returncode == 0 and '"include"' in proc.stdout, proc.stdout + proc.stderr
    assert "uv binary not found" not in proc.stdout + proc.stderr
    # the control: the same session without the filter says it
    unfiltered = tmp_path / "noxfile.py"
    unfiltered.write_text("\n".join(ln for ln in (REPO / "noxfile.py").read_text().splitlines() if "addFilter" not in ln))
    shutil.copytree(REPO / "ci", tmp_path / "ci", ignore=shutil.ignore_patterns("__pycache__"))
    proc = run(*args, "-f", str(unfiltered), "--", "--compact", env=env)
    assert proc.returncode == 0 and "uv binary not found" in proc.stderr, proc.stderr


def test_the_index_a_record_names(tmp_path, monkeypatch):
    """Local builds point at the index they wrote; the release pipeline's at the Pages site of
    its repository; SAGEATTN3_INDEX_URL overrides both. The settings are the toolchain's,
    frozen when it was resolved: a change to the environment afterwards reaches no build."""
    from ci.runtime.env import FactoryEnv
    from ci.stages.build import record_index_url

    def url(**environ):
        return record_index_url(tmp_path / "dist", FactoryEnv.from_environ(environ))

    assert url() == (tmp_path / "dist" / "index").as_uri() + "/"
    assert url(GITHUB_REPOSITORY="SomeOrg/sageattn3-wheels") == "https://someorg.github.io/sageattn3-wheels/"
    assert url(GITHUB_REPOSITORY="SomeOrg/sageattn3-wheels",
               SAGEATTN3_INDEX_URL="https://wheels.example.org/sa3") == "https://wheels.example.org/sa3/"
    frozen = FactoryEnv.from_environ({"SAGEATTN3_INDEX_URL": "https://wheels.example.org/sa3"})
    monkeypatch.setenv("SAGEATTN3_INDEX_URL", "https://elsewhere.example.org/")
    assert record_index_url(tmp_path / "dist", frozen) == "https://wheels.example.org/sa3/"
