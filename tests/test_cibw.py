"""The release jobs' per-target environment, without a runner: where each target's torch comes
from (build, verify, ABI guard), what a job exports, and the commands its steps run on Windows
and aarch64 as well as Linux x86_64."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ci.toolchain.targets import Matrix
from ci.toolchain.torch_source import (
    INDEX_ENV,
    PYTORCH_INDEX,
    TorchSource,
    foreign_torch_source,
    torch_source,
    unreachable_reason,
)
from ci.toolchain.variant import cuda_tag

MATRIX = Matrix.load()
TARGETS = MATRIX.targets
BY_ID = {t.id: t for t in TARGETS}


@pytest.fixture
def no_index(monkeypatch):
    monkeypatch.delenv(INDEX_ENV, raising=False)


# -- the torch a target builds and verifies with ------------------------------------------

@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_release_takes_every_targets_torch_from_its_own_pytorch_index(target, no_index):
    src = torch_source(target, PYTORCH_INDEX)
    assert src.requirement == f"torch=={target.build_torch}"
    assert src.index_url == f"{PYTORCH_INDEX}/{cuda_tag(target.cuda)}"
    assert src.cuda == target.cuda
    # --index-url (replaces PyPI), never --extra-index-url: PyPI's CPU torch cannot win
    assert src.pip_args() == [f"torch=={target.build_torch}", "--index-url", src.index_url]
    assert "--extra-index-url" not in src.pip_args()
    assert unreachable_reason(target, PYTORCH_INDEX) is None


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_without_pytorchs_index_pypi_only_where_it_is_the_same_cuda_build(target, no_index):
    src = torch_source(target)
    pypi_is_it = target.os.key == "linux-x86_64" and target.cuda == target.build_torch_pypi_cuda
    if pypi_is_it:
        assert src.index_url is None and src.pip_args() == [f"torch=={target.build_torch}"]
        assert unreachable_reason(target) is None
    else:
        # Windows and aarch64 always (PyPI's torch is a CPU build there), x86_64 when PyPI's
        # default CUDA variant differs from the target's
        assert src.index_url == f"{PYTORCH_INDEX}/{cuda_tag(target.cuda)}"
        why = unreachable_reason(target)
        assert why and INDEX_ENV in why and src.index_url in why
        if target.os.key != "linux-x86_64":
            assert "CPU build" in why
    assert src.cuda == target.cuda


def test_windows_and_aarch64_never_use_pypi(no_index):
    others = [t for t in TARGETS if t.os.key in ("windows-amd64", "linux-aarch64")]
    assert len(others) == 15  # 16 until torch 2.8 + CUDA 12.8 on aarch64 (never published) left the matrix
    for t in others:
        for root in (None, "http://127.0.0.1:9/whl"):
            assert torch_source(t, root).index_url is not None, t.id


def test_the_index_root_comes_from_the_argument_or_the_environment(monkeypatch):
    t = BY_ID["linux-x86_64-cu130-torch2.10-stable"]
    monkeypatch.delenv(INDEX_ENV, raising=False)
    assert torch_source(t).index_url is None  # PyPI's 2.14.1 is the cu130 build
    monkeypatch.setenv(INDEX_ENV, "http://127.0.0.1:8123/whl/")
    assert torch_source(t).index_url == "http://127.0.0.1:8123/whl/cu130"
    assert torch_source(t, "https://mirror.example/pt").index_url == "https://mirror.example/pt/cu130"
    assert unreachable_reason(BY_ID["windows-amd64-cu128-torch2.7"]) is None  # configured


def test_a_source_accepts_only_its_own_build():
    src = TorchSource("torch==2.8.0", "https://x/cu128", "12.8")
    assert src.accepts("2.8.0+cu128", "12.8") and src.accepts("2.8.0", "12.8")
    assert not src.accepts("2.8.0+cpu", None) and not src.accepts("2.8.0", "12.6")
    assert not src.accepts("2.9.1+cu128", "12.8")
    assert "CUDA 12.8 build" in src.describe() and "https://x/cu128" in src.describe()


# -- the ABI guard's foreign torch ---------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_foreign_torch_is_a_cpu_build_of_a_line_the_wheel_does_not_serve(target):
    f = foreign_torch_source(target, MATRIX, target.python, PYTORCH_INDEX)
    assert f.index_url == f"{PYTORCH_INDEX}/cpu" and f.cuda is None
    line = MATRIX.line(".".join(f.version.split(".")[:2]))
    assert target.python in line.python  # installable in the verify Python
    assert not target.variant.serves(f.version, target.cuda)  # outside the range even as CUDA
    assert line.line not in target.torch_lines


def test_foreign_line_is_the_nearest_older_one():
    assert foreign_torch_source(BY_ID["linux-x86_64-cu130-torch2.10-stable"], MATRIX, "3.10").version == "2.9.1"
    assert foreign_torch_source(BY_ID["linux-x86_64-cu128-torch2.9"], MATRIX, "3.10").version == "2.8.0"
    assert foreign_torch_source(BY_ID["linux-x86_64-cu128-torch2.8"], MATRIX, "3.9").version == "2.7.1"
    # 2.7's nearest is 2.8 (nothing older in the matrix)
    assert foreign_torch_source(BY_ID["windows-amd64-cu128-torch2.7"], MATRIX, "3.9").version == "2.8.0"


def test_a_cuda_foreign_directory_must_still_be_refused():
    t = BY_ID["linux-x86_64-cu130-torch2.10-stable"]
    f = foreign_torch_source(t, MATRIX, "3.10", "http://127.0.0.1:1/whl", directory="cu128")
    assert f.index_url == "http://127.0.0.1:1/whl/cu128" and f.cuda == "12.8" and f.version == "2.9.1"


# -- what a job exports -----------------------------------------------------------------------

GiB = 2**30


def test_parallel_compiles_are_capped_by_memory():
    from ci.release.cibw_job import nvcc_jobs

    assert nvcc_jobs(4, 16 * GiB) == 4  # a hosted runner
    assert nvcc_jobs(4, int(15.6 * GiB)) == 4  # what a "16 GB" hosted runner reports
    assert nvcc_jobs(4, int(11.6 * GiB)) == 3
    assert nvcc_jobs(16, 16 * GiB) == 4  # CPUs alone would oversubscribe its memory
    assert nvcc_jobs(2, 64 * GiB) == 2
    assert nvcc_jobs(4, 3 * GiB) == 1  # never zero
    assert nvcc_jobs() >= 1  # this machine's own figures


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_every_job_exports_pytorchs_index_the_compile_cap_and_cleanup(target):
    from ci.release.cibw_job import identifier, job_env

    env = job_env(target, jobs=3)
    assert env["SAGEATTN3_PYTORCH_INDEX"] == PYTORCH_INDEX
    assert env["MAX_JOBS"] == "3" and env["SAGEATTN3_CI_CLEANUP"] == "1"
    assert env["CIBW_BUILD"] == identifier(target) and env["SAGEATTN3_TARGET"] == target.id


# -- every job resolved and checked -------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_every_job_resolves_without_problems(target):
    from ci.release.cibw_job import check_job, plan_job

    job = plan_job(target, MATRIX)
    assert check_job(job, MATRIX) == []
    torch_step = dict(job.steps)["torch"]
    assert torch_step == ("pip", "install", f"torch=={target.build_torch}", "--index-url",
                          f"{PYTORCH_INDEX}/{cuda_tag(target.cuda)}")
    assert dict(job.steps)["guard"][-1] == f"{PYTORCH_INDEX}/cpu"
    assert job.requires_python == f">={target.floor_python}" and job.verify_python == target.python


def test_a_windows_job_installs_cuda_with_nvidias_installer_and_msvc():
    from ci.release.cibw_job import check_job, plan_job

    job = plan_job(BY_ID["windows-amd64-cu130-torch2.10-stable"], MATRIX)
    assert job.runner == "windows-2022" and job.identifier == "cp310-win_amd64"
    steps = [name for name, _ in job.steps]
    assert steps.index("cuda") < steps.index("msvc") < steps.index("build") < steps.index("repair") < steps.index("verify")
    cuda = dict(job.steps)["cuda"]
    assert cuda[0] == ("https://developer.download.nvidia.com/compute/cuda/13.0.2/network_installers/"
                       "cuda_13.0.2_windows_network.exe")
    assert {"-s", "nvcc_13.0", "crt_13.0", "nvvm_13.0", "cudart_13.0", "visual_studio_integration_13.0"} <= set(cuda)
    assert "%SAGEATTN3_FACTORY_PYTHON%" in dict(job.steps)["repair"][0]
    # a plan that took torch from PyPI (its Windows torch is a CPU build) is caught
    import dataclasses

    bad = dataclasses.replace(job, torch=TorchSource("torch==2.14.1", None, "13.0"))
    assert any("not PyTorch's cu130 index" in p for p in check_job(bad, MATRIX))
    broken = dataclasses.replace(job, steps=tuple((n, a[:-2]) if n == "cuda" else (n, a) for n, a in job.steps))
    assert any("installer components" in p for p in check_job(broken, MATRIX))


def test_an_aarch64_job_uses_the_arm_runner_and_sbsa_packages():
    from ci.release.cibw_job import check_job, plan_job

    job = plan_job(BY_ID["linux-aarch64-cu129-torch2.8"], MATRIX)
    assert job.runner == "ubuntu-24.04-arm" and job.identifier == "cp39-manylinux_aarch64"
    flat = " ".join(" ".join(a) for n, a in job.steps if n == "cuda")
    assert "repos/rhel8/sbsa/cuda-rhel8.repo" in flat and "cuda-nvcc-12-9" in flat
    assert job.torch.index_url == f"{PYTORCH_INDEX}/cu129"
    assert job.foreign.requirement == "torch==2.7.1" and job.foreign.index_url == f"{PYTORCH_INDEX}/cpu"
    assert check_job(job, MATRIX) == []
    arm13 = plan_job(BY_ID["linux-aarch64-cu130-torch2.10-stable"], MATRIX)
    assert dict(arm13.steps)["cuda"][0] == "(PyPI)"  # 13.x: provisioned from PyPI in before-all


def test_the_plan_command_prints_every_job_and_exits_zero():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ci.release.cibw", "plan"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" on windows-2022 (") == 8 and proc.stdout.count(" on ubuntu-24.04-arm (") == 7
    assert "PROBLEM" not in proc.stdout


# -- the steps' own code --------------------------------------------------------------------

def test_the_shim_builds_with_its_own_python_for_the_factory(tmp_path, monkeypatch):
    """cibuildwheel's build Python runs the shim; the factory it calls must make the torch
    environment for that Python (the one verify uses next)."""
    import importlib.util
    import json
    import stat
    import sys

    from ci.release import cibw_job

    fake = tmp_path / "factory"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys, pathlib\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "(out / 'env.json').write_text(json.dumps({k: v for k, v in os.environ.items()\n"
        "                                          if k.startswith(('SAGEATTN3_', 'PEP517_', '_PYPROJECT_HOOKS_'))}))\n"
        "(out / 'sageattn3-0.1.0-cp310-abi3-linux_x86_64.whl').write_bytes(b'')\n"
        "print(sys.argv[1:])\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SAGEATTN3_FACTORY_PYTHON", str(fake))
    # what pip's hook runner sets for the shim's own backend (old and new names)
    monkeypatch.setenv("PEP517_BACKEND_PATH", str(cibw_job.PACKAGE_DIR))
    monkeypatch.setenv("_PYPROJECT_HOOKS_BACKEND_PATH", str(cibw_job.PACKAGE_DIR))
    spec = importlib.util.spec_from_file_location("factory_backend_t", cibw_job.PACKAGE_DIR / "factory_backend.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    assert backend.build_wheel(str(tmp_path)) == "sageattn3-0.1.0-cp310-abi3-linux_x86_64.whl"
    env = json.loads((tmp_path / "env.json").read_text())
    here = "%d.%d" % sys.version_info[:2]
    assert env["SAGEATTN3_BUILD_PYTHON"] == here
    assert env["SAGEATTN3_PYTHON_" + here.replace(".", "_")]
    # the payload's own build must not inherit the shim's backend-path
    assert not [k for k in env if k.startswith(("PEP517_", "_PYPROJECT_HOOKS_"))]


def test_build_python_follows_the_shim(monkeypatch):
    import sys

    from ci.stages.build import BuildError
    from ci.runtime.env import FactoryEnv
    from ci.stages.resolve import build_python

    t = BY_ID["linux-x86_64-cu130-torch2.10-stable"]  # floor 3.10
    here = "%d.%d" % sys.version_info[:2]
    monkeypatch.setenv("SAGEATTN3_BUILD_PYTHON", here)
    assert build_python(t, FactoryEnv.from_environ()) == here
    monkeypatch.setenv("SAGEATTN3_BUILD_PYTHON", "3.9")
    with pytest.raises(BuildError, match="older than the target's Python 3.10"):
        build_python(t, FactoryEnv.from_environ())


def _serve(handler_cls):
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_installer_download_retries_and_times_out(tmp_path):
    import http.server
    import time

    from ci.release.runner_setup import CibwError, download

    payload = b"MZ" + bytes(range(256)) * 64
    calls = {"n": 0}

    class Flaky(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            calls["n"] += 1
            if self.path == "/stall":
                time.sleep(3)  # longer than the client's read timeout
                return
            if calls["n"] == 1:
                self.send_error(503)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = _serve(Flaky)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        out = download(f"{base}/cuda.exe", tmp_path / "cuda.exe", timeout=2, attempts=3, log=lambda m: None)
        assert out.read_bytes() == payload and calls["n"] == 2  # one 503, then the file
        calls["n"] = 10
        t0 = time.monotonic()
        with pytest.raises(CibwError, match="after 2 attempts"):
            download(f"{base}/stall", tmp_path / "stalled.exe", timeout=0.5, attempts=2, log=lambda m: None)
        assert time.monotonic() - t0 < 15
        assert not (tmp_path / "stalled.exe").exists() and not (tmp_path / "stalled.exe.part").exists()
    finally:
        server.shutdown()


def test_cleanup_after_build_keeps_the_compiler_cache_and_the_env_verify_reuses(tmp_path):
    from ci.release.runner_setup import cleanup_after_build

    cache = tmp_path / "cache"
    for d in ("cuda/13.0/bin", "cutlass/4.2.0.0/include", "envs/py3.10-torch-2.14.1-aaa/lib",
              "envs/py3.12-torch-2.14.1-bbb/lib", "sccache/x", "stage/abc"):
        (cache / d).mkdir(parents=True)
        (cache / d / "f").write_bytes(b"x" * 1000)
    keep = cache / "envs" / "py3.10-torch-2.14.1-aaa"
    freed = cleanup_after_build(BY_ID["linux-x86_64-cu130-torch2.10-stable"], keep=[keep], cache=cache,
                                stage=cache / "stage", purge_pip=False, log=lambda m: None)
    assert not (cache / "cuda").exists() and not (cache / "cutlass").exists() and not (cache / "stage").exists()
    assert not (cache / "envs" / "py3.12-torch-2.14.1-bbb").exists()
    assert keep.exists() and (cache / "sccache" / "x" / "f").exists()
    assert sum(freed.values()) == 4000


def test_free_disk_removes_the_listed_paths_and_reports_the_gain(tmp_path):
    from ci.release.runner_setup import RUNNER_BLOAT, free_disk

    junk = tmp_path / "dotnet"
    (junk / "sdk").mkdir(parents=True)
    (junk / "sdk" / "big").write_bytes(b"\0" * (1 << 20))
    lines = []
    free_disk((str(junk), str(tmp_path / "absent")), use_sudo=False, log=lines.append)
    assert not junk.exists() and "GiB free before" in lines[0]
    assert "/usr/share/dotnet" in RUNNER_BLOAT["linux"] and r"C:\Android" in RUNNER_BLOAT["windows"]


def test_free_disk_on_windows_is_best_effort_within_its_budget(tmp_path):
    """Windows deletes file by file: within the budget, the rest left in place, never an error;
    real files here, removed the way the Windows job removes them."""
    from ci.release.runner_setup import WINDOWS_DISK_BUDGET_S, free_disk

    big = tmp_path / "Android" / "sdk"
    for i in range(40):
        (big / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (big / f"d{i % 4}" / f"f{i}").write_bytes(b"x" * 4096)
    ro = big / "d0" / "readonly"
    ro.write_bytes(b"x")
    ro.chmod(0o444)
    other = tmp_path / "CodeQL"
    (other / "x").mkdir(parents=True)
    lines = []
    free_disk((str(tmp_path / "Android"), str(other)), platform="windows", budget_s=0, log=lines.append)
    assert (tmp_path / "Android").exists() and other.exists()  # no time: nothing (or little) removed
    assert any("best effort" in ln and "partly removed" in ln and str(other) in ln for ln in lines), lines
    lines.clear()
    free_disk((str(tmp_path / "Android"), str(other)), platform="windows", log=lines.append)
    assert not (tmp_path / "Android").exists() and not other.exists()
    assert not any("best effort" in ln for ln in lines) and 0 < WINDOWS_DISK_BUDGET_S < 20 * 60


def test_free_disk_reports_the_drive_it_deletes_from():
    """The report names the drive of the deleted paths (C: for the preinstalled software),
    not the workspace's (D: on a Windows runner)."""
    from pathlib import PurePosixPath, PureWindowsPath

    from ci.release.runner_setup import RUNNER_BLOAT, _drive

    assert {_drive(p, PureWindowsPath) for p in RUNNER_BLOAT["windows"]} == {"C:\\"}
    assert _drive(r"D:\a\sageattn3\sageattn3", PureWindowsPath) == "D:\\"
    assert {_drive(p, PurePosixPath) for p in RUNNER_BLOAT["linux"]} == {"/"}


def test_the_build_stage_keeps_its_full_log_for_the_job_to_upload(tmp_path, monkeypatch):
    from ci.release.cibw import LOG_DIR_ENV, keep_build_log

    t = BY_ID["windows-amd64-cu130-torch2.10-stable"]
    monkeypatch.setenv("SAGEATTN3_DIST", str(tmp_path / "dist"))
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "logs"))
    assert keep_build_log(t, log=lambda m: None) is None  # no build log: nothing
    log = tmp_path / "dist" / "raw" / f"{t.id}.build.log"
    log.parent.mkdir(parents=True)
    text = "".join(f"line {i}\n" for i in range(5000))  # far more than the error's last 40 lines
    log.write_text(text)
    kept = keep_build_log(t, log=lambda m: None)
    assert kept == tmp_path / "logs" / f"{t.id}.build.log" and kept.read_text() == text
    # a log an earlier build left is not this build's
    assert keep_build_log(t, since=log.stat().st_mtime + 60, log_dir=tmp_path / "other", log=lambda m: None) is None


def test_verify_takes_the_interpreter_cibuildwheel_tests_with(tmp_path, monkeypatch):
    """The test-command passes its `python` (the target's floor Python): verify makes its
    environments from that interpreter's base, and refuses one of another Python."""
    import subprocess
    import sys
    import tomllib

    from ci.release import cibw, cibw_job, runner_setup
    from ci.runtime.env import python_override_var as _env_var

    cfg = tomllib.loads(cibw_job.CONFIG_FILE.read_text())["tool"]["cibuildwheel"]
    for plat in ("linux", "windows"):
        assert cfg[plat]["test-command"].endswith("verify --wheel {wheel} --python-exe python"), plat
    venv = tmp_path / "venv-test"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    vpy = venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    here = "%d.%d" % sys.version_info[:2]
    monkeypatch.delenv(_env_var(here), raising=False)
    monkeypatch.setenv("PATH", str(vpy.parent), prepend=os.pathsep)
    version, base = cibw.use_python("python")  # as the test-command names it: from PATH
    assert version == here and os.environ[_env_var(here)] == base
    assert Path(base).resolve() == Path(sys._base_executable).resolve() and not Path(base).is_relative_to(venv)
    with pytest.raises(runner_setup.CibwError, match="no such interpreter"):
        cibw.use_python(str(tmp_path / "nope" / "python"))
    # a cp39 target's verify refuses a test Python that is not 3.9 (before touching the wheel)
    monkeypatch.setenv("SAGEATTN3_TARGET", "linux-x86_64-cu128-torch2.8")
    monkeypatch.delenv("SAGEATTN3_VERIFY_PYTHONS", raising=False)
    if here != "3.9":
        with pytest.raises(runner_setup.CibwError, match=f"is Python {here}, but linux-x86_64-cu128-torch2.8 verifies in 3.9"):
            cibw.verify_wheel(tmp_path / "x.whl", python_exe=str(vpy), log=lambda m: None)


# -- the stages the hooks run -------------------------------------------------------------

def test_the_hooks_run_the_stages_a_payload_projects_cibw_stages_py_defines(tmp_path, monkeypatch):
    """$SAGEATTN3_CIBW_PAYLOAD names a project whose cibw_stages.py (loaded by its path) replaces
    the factory's stages; each hook finds the target and hands its arguments over."""
    from ci.release import cibw

    monkeypatch.delenv(cibw.PAYLOAD_ENV, raising=False)
    assert cibw.stages() is cibw.FACTORY_STAGES
    assert cibw.FACTORY_STAGES.build is cibw.build_sageattn3 and cibw.FACTORY_STAGES.verify is cibw.verify_sageattn3
    (tmp_path / cibw.STAGES_FILE).write_text(
        "import dataclasses\nfrom ci.release.cibw import FACTORY_STAGES\nCALLS = []\n"
        "def build(matrix, target, wheel_dir, log):\n    CALLS.append(('build', target.id, wheel_dir)); return wheel_dir / 'w.whl'\n"
        "def repair(target, wheel, dest_dir, log):\n    CALLS.append(('repair', wheel.name)); return dest_dir / wheel.name\n"
        "def verify(matrix, target, wheel, pythons, python_exe, log):\n    CALLS.append(('verify', pythons, python_exe))\n"
        "STAGES = dataclasses.replace(FACTORY_STAGES, build=build, repair=repair, verify=verify)\n")
    monkeypatch.setattr(cibw, "REPO", tmp_path.parent)  # the payload project inside the project
    monkeypatch.setenv(cibw.PAYLOAD_ENV, tmp_path.name)
    monkeypatch.setenv("SAGEATTN3_TARGET", "linux-x86_64-cu128-torch2.8")
    monkeypatch.delenv("SAGEATTN3_VERIFY_PYTHONS", raising=False)
    got = cibw.stages()
    assert got is not cibw.FACTORY_STAGES and got.install_cuda is cibw.FACTORY_STAGES.install_cuda
    assert cibw.build_into(tmp_path / "out") == tmp_path / "out" / "w.whl"
    assert cibw.repair_into(tmp_path / "x.whl", tmp_path / "dest") == tmp_path / "dest" / "x.whl"
    cibw.verify_wheel(tmp_path / "x.whl", python_exe="python3.9")
    calls = sys.modules[got.build.__module__].CALLS
    assert calls == [("build", "linux-x86_64-cu128-torch2.8", tmp_path / "out"), ("repair", "x.whl"),
                     ("verify", ["3.9"], "python3.9")]


def test_a_payload_project_without_its_stages_is_an_error(tmp_path, monkeypatch):
    from ci.release import cibw, cibw_local
    from ci.release.runner_setup import CibwError

    project = tmp_path / "project"
    (project / "payload").mkdir(parents=True)
    monkeypatch.setattr(cibw, "REPO", project)  # a project of its own, with a payload folder in it
    monkeypatch.setenv(cibw.PAYLOAD_ENV, "payload")
    with pytest.raises(CibwError, match=f"no {cibw.STAGES_FILE} at"):
        cibw.stages()
    (project / "payload" / cibw.STAGES_FILE).write_text("STAGES = 'the factory'\n")
    with pytest.raises(CibwError, match="STAGES is str, not a ci.release.cibw.Stages"):
        cibw.stages()
    # a file outside the project is never loaded, whatever it holds
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / cibw.STAGES_FILE).write_text("raise SystemExit('loaded')\n")
    monkeypatch.setenv(cibw.PAYLOAD_ENV, "../elsewhere")
    with pytest.raises(CibwError, match="a payload project lies inside the project"):
        cibw.stages()
    monkeypatch.undo()
    with pytest.raises(cibw_local.LocalCibwError, match="must lie inside the repository"):
        cibw_local.payload_relative(tmp_path)
    assert cibw_local.payload_relative(Path(__file__).parent / "cibw_probe") == "tests/cibw_probe"
    monkeypatch.setenv(cibw.PAYLOAD_ENV, "tests/cibw_probe")  # the probe's, as tests/test_cibw_local.py runs them
    assert isinstance(probe := cibw.stages(), cibw.Stages) and probe.build.__module__ == "sageattn3_cibw_stages"
