"""What the release runners download is pinned and checked (issue 38, item 7): CUDA 12.x on
Linux at exact package versions with a gcc-toolset that nvcc is told to use (-ccbin), and the
Windows installer's sha256 checked before it runs. dnf, rpm and NVIDIA's installer do not run
here: these tests check the exact commands and flags the jobs run, and run the checks the jobs
make on what was installed (sha256 on real files, a real g++, rpm's output format)."""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ci.release import runner_setup
from ci.release.runner_setup import CibwError
from ci.toolchain.targets import Matrix

MATRIX = Matrix.load()
TARGETS = MATRIX.targets
BY_ID = {t.id: t for t in TARGETS}
REPO = Path(__file__).resolve().parent.parent
TOOLSET_CXX = runner_setup.toolset_cxx(runner_setup.CUDA12_GCC_TOOLSET)  # where this machine has it, if at all


def _cuda12_linux(t) -> bool:
    return t.os.platform == "linux" and int(t.cuda.split(".")[0]) < 13


# -- Linux: pinned packages, the gcc-toolset, -ccbin ------------------------------------------

@pytest.mark.parametrize("target", [t for t in TARGETS if _cuda12_linux(t)], ids=lambda t: t.id)
def test_cuda12_linux_jobs_install_exact_package_versions_and_the_toolset(target):
    cmds = runner_setup.cuda_commands(target)
    major, minor = target.cuda.split(".")
    install = next(c for c in cmds if any(a.startswith("cuda-nvcc-") for a in c))
    pkgs = [a for a in install if not a.startswith("-")][2:]
    assert len(pkgs) == len(runner_setup.RPM_PACKAGES)
    for name, spec in zip(runner_setup.RPM_PACKAGES, pkgs):
        # name-major-minor-version-release: no floating `cuda-nvcc-12-8`
        assert re.fullmatch(rf"{re.escape(name)}-{major}-{minor}-\d+(\.\d+){{2,3}}-{runner_setup.RPM_RELEASE}", spec), spec
    # nvcc, the runtime and NVRTC are numbered by the CUDA release itself: 12.8.x for CUDA 12.8
    for name in ("cuda-nvcc", "cuda-cudart-devel", "cuda-nvrtc-devel"):
        assert runner_setup.RPM_VERSIONS[target.cuda][name].startswith(f"{target.cuda}.")
    # the toolset is installed (from AlmaLinux's AppStream) before NVIDIA's repository is added
    toolset = cmds.index(["dnf", "install", "-y", "--setopt=install_weak_deps=False",
                          f"gcc-toolset-{runner_setup.CUDA12_GCC_TOOLSET}-gcc-c++"])
    assert toolset < cmds.index(install)
    assert runner_setup.CUDA12_GCC_TOOLSET <= runner_setup.CUDA_MAX_GCC[target.cuda]


def test_an_unpinned_cuda_release_is_refused_with_what_to_add(monkeypatch):
    monkeypatch.delitem(runner_setup.RPM_VERSIONS, "12.9")
    with pytest.raises(CibwError, match=r"no pinned RPM versions .* CUDA 12\.9: add them to RPM_VERSIONS"):
        runner_setup.cuda_commands(BY_ID["linux-x86_64-cu129-torch2.8"])


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_nvcc_gets_the_toolset_by_ccbin_only_for_cuda12_on_linux(target):
    from ci.payload.interface import build_commands
    from ci.toolchain.flags import profile_for

    prof = profile_for(target, MATRIX.stable_abi_floor, cross=False)  # as on the target's own runner
    ccbin = [f for f in prof["nvcc_flags"] if f.startswith("-ccbin")]
    if _cuda12_linux(target):
        assert ccbin == [f"-ccbin={TOOLSET_CXX}"] and prof["host_compiler"] == TOOLSET_CXX
        # the payload's command builder: nvcc gets it, and the same g++ compiles the torch unit and links
        bc = build_commands()
        tools = bc.tools("gcc", "/usr/local/cuda-12.8", cxx=prof["host_compiler"])
        cu = bc.compile_command(tools, prof, "csrc/attn/attn_launch.cu", "o.o", [])
        cpp = bc.compile_command(tools, prof, prof["torch_unit"], "t.o", [])
        assert f"-ccbin={TOOLSET_CXX}" in cu and cpp[0] == TOOLSET_CXX
        assert bc.link_command(tools, prof, ["o.o", "t.o"], "_C.abi3.so", [])[0] == TOOLSET_CXX
    else:
        assert ccbin == [] and "host_compiler" not in prof
    # the proof flavour compiles a per-torch target with CUDA 13: the image's g++ is fine there
    if target.os.platform == "linux" and not target.variant.stable:
        proof = profile_for(target, MATRIX.stable_abi_floor, cuda="13.0", cross=False)
        assert not any(f.startswith("-ccbin") for f in proof["nvcc_flags"])


def test_the_profile_refuses_a_host_compiler_it_cannot_hand_to_nvcc():
    from ci.payload.interface import build_profile

    bp = build_profile()
    kw = dict(cuda="12.8", archs=["sm_120a"], torch_version="2.7.1", stable_abi_floor=None)
    with pytest.raises(ValueError, match="native gcc-style builds only"):
        bp.profile(platform="windows", host_compiler=TOOLSET_CXX, **kw)
    with pytest.raises(ValueError, match="native gcc-style builds only"):
        bp.profile(platform="linux", host_compiler=TOOLSET_CXX, cross_compiler="aarch64-linux-gnu-g++",
                   machine="aarch64", **kw)


def test_a_cuda12_job_plan_without_the_toolset_or_the_pins_is_a_problem():
    import dataclasses

    from ci.release.cibw_job import check_job, plan_job

    job = plan_job(BY_ID["linux-x86_64-cu128-torch2.8"], MATRIX)
    assert check_job(job, MATRIX) == []
    floating = tuple((n, tuple(re.sub(r"^((?:cuda|lib)[a-z-]+-12-8)-[\d.]+-1$", r"\1", a) for a in argv))
                     if n == "cuda" else (n, argv) for n, argv in job.steps)
    assert any("not the pinned versions" in p for p in check_job(dataclasses.replace(job, steps=floating), MATRIX))
    no_toolset = tuple((n, a) for n, a in job.steps if not (n == "cuda" and "gcc-toolset-13-gcc-c++" in a))
    assert any("does not install gcc-toolset-13" in p for p in check_job(dataclasses.replace(job, steps=no_toolset), MATRIX))


def test_before_all_and_the_install_script_are_valid_bash():
    from ci.release.cibw import install_cuda_plan
    from ci.release.cibw_job import job_env, resolve

    bash = shutil.which("bash")
    for tid in ("linux-x86_64-cu128-torch2.7", "linux-aarch64-cu129-torch2.8", "linux-x86_64-cu130-torch2.9"):
        t = BY_ID[tid]
        # cibuildwheel's own reading of ci/cibuildwheel.toml: what the container runs first
        before = resolve(t, job_env(t, jobs=2)).command("before_all", project="/project", package="/project/ci/release/cibw_project")
        assert "cibw/__main__.py install-cuda" in before
        subprocess.run([bash, "-n", "-c", before], check=True)
        script = install_cuda_plan(t)
        subprocess.run([bash, "-n", "-c", script], check=True)
        if _cuda12_linux(t):
            assert "gcc-toolset-13-gcc-c++" in script
            assert '"$(rpm -ql gcc-toolset-13-gcc-c++ | grep \'/bin/g++$\')" -dumpfullversion' in script
            assert f"cuda-nvcc-{t.cuda.replace('.', '-')}-{runner_setup.RPM_VERSIONS[t.cuda]['cuda-nvcc']}-1" in script
    out = subprocess.run([sys.executable, "-m", "ci.release.cibw", "install-cuda", "--dry-run", "--target",
                          "linux-x86_64-cu128-torch2.7"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout == install_cuda_plan(BY_ID["linux-x86_64-cu128-torch2.7"])


def test_rpms_query_must_report_exactly_the_pins():
    pins = runner_setup.RPM_VERSIONS["12.8"]
    exact = "".join(f"{p}-12-8 {v}-1\n" for p, v in pins.items())
    assert runner_setup.installed_rpm_problems(exact, "12.8") == []
    drifted = exact.replace("cuda-nvcc-12-8 12.8.93-1", "cuda-nvcc-12-8 12.8.61-1")
    missing = exact.replace("libcurand-devel-12-8 10.3.9.90-1\n", "package libcurand-devel-12-8 is not installed\n")
    assert runner_setup.installed_rpm_problems(drifted, "12.8") == ["cuda-nvcc-12-8: installed 12.8.61-1, pinned 12.8.93-1"]
    assert runner_setup.installed_rpm_problems(missing, "12.8") == ["libcurand-devel-12-8: not installed, pinned 10.3.9.90-1"]


def _fake_gcc(tmp_path: Path, version: str) -> str:
    exe = tmp_path / f"g++-{version}"
    exe.write_text(f"#!/bin/sh\necho {version}\n")
    exe.chmod(0o755)
    return str(exe)


def test_the_host_compiler_check_wants_the_toolsets_major_within_cudas_limit(tmp_path):
    assert runner_setup.check_host_compiler(_fake_gcc(tmp_path, "13.3.1"), "12.8") == "13.3.1"
    with pytest.raises(CibwError, match=r"is GCC 15\.1\.1, expected gcc-toolset-13"):
        runner_setup.check_host_compiler(_fake_gcc(tmp_path, "15.1.1"), "12.9")
    with pytest.raises(CibwError, match=r"CUDA 12\.8 accepts GCC up to 14"):
        runner_setup.check_host_compiler(_fake_gcc(tmp_path, "15.1.1"), "12.8", toolset=15)
    with pytest.raises(CibwError, match=r"did not run .*dnf install gcc-toolset-13-gcc-c\+\+"):
        runner_setup.check_host_compiler(str(tmp_path / "absent-g++"), "12.8")
    real = shutil.which("g++")
    if real:  # this machine's own g++ answers the same way (Debian 12: GCC 12, not the toolset)
        major = subprocess.run([real, "-dumpversion"], capture_output=True, text=True).stdout.strip().split(".")[0]
        if major != "13":
            with pytest.raises(CibwError, match=rf"is GCC {major}[.\d]*, expected gcc-toolset-13"):
                runner_setup.check_host_compiler(real, "12.8")


# -- Windows: the installer's sha256 -------------------------------------------------------

def test_every_pinned_installer_hash_is_a_sha256_and_every_windows_release_has_an_entry():
    for t in TARGETS:
        if t.os.platform == "windows":
            full = runner_setup.WINDOWS_CUDA_RELEASES[t.cuda]
            assert full in runner_setup.WINDOWS_INSTALLER_SHA256, f"{t.id}: add {full} to WINDOWS_INSTALLER_SHA256"
    for full, pin in runner_setup.WINDOWS_INSTALLER_SHA256.items():
        assert pin is None or re.fullmatch(r"[0-9a-f]{64}", pin), (full, pin)


def test_the_sha256_check_passes_the_pinned_file_and_stops_another(tmp_path):
    exe = tmp_path / "cuda_12.8.1_windows_network.exe"
    exe.write_bytes(b"MZ" + os.urandom(4096))
    right = hashlib.sha256(exe.read_bytes()).hexdigest()
    assert runner_setup.check_sha256(exe, right, "the installer") == right
    assert runner_setup.check_sha256(exe, right.upper(), "the installer") == right  # as Get-FileHash prints it
    wrong = "0" * 64
    with pytest.raises(CibwError, match=rf"the installer: sha256 {right}, but ci/release/runner_setup.py pins {wrong}: "
                                        r"this is not the file that was pinned, and it was not run"):
        runner_setup.check_sha256(exe, wrong, "the installer")
    with pytest.raises(CibwError, match=r"no sha256 pinned for the CUDA 9\.9\.9 Windows installer .*"
                                        r"add its sha256 to WINDOWS_INSTALLER_SHA256"):
        runner_setup.pinned_installer_sha256("9.9.9")


@pytest.fixture
def installer_server():
    payload = b"MZ" + bytes(range(256)) * 32

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", payload
    finally:
        server.shutdown()


def _windows_install(monkeypatch, tmp_path, base: str, pin: str | None) -> list[list[str]]:
    """install_cuda for a Windows CUDA 12.8 target, its installer served from ``base`` and
    pinned to ``pin``; what it ran is recorded instead of run (returned)."""
    ran: list[list[str]] = []
    monkeypatch.setattr(runner_setup, "WINDOWS_INSTALLER", base + "/{full}/cuda_{full}_windows_network.exe")
    monkeypatch.setitem(runner_setup.WINDOWS_INSTALLER_SHA256, "12.8.1", pin)
    monkeypatch.setattr(runner_setup.subprocess, "run", lambda cmd, **kw: ran.append(list(cmd)))
    monkeypatch.setenv("ProgramFiles", str(tmp_path / "pf"))
    nvcc = tmp_path / "pf" / "NVIDIA GPU Computing Toolkit" / "CUDA" / "v12.8" / "bin" / "nvcc.exe"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_bytes(b"")
    runner_setup.install_cuda(BY_ID["windows-amd64-cu128-torch2.7"], log=lambda m: None)
    return ran


def test_the_windows_job_runs_the_installer_only_after_its_sha256_matched(monkeypatch, tmp_path, installer_server):
    base, payload = installer_server
    ran = _windows_install(monkeypatch, tmp_path, base, hashlib.sha256(payload).hexdigest())
    assert len(ran) == 1 and ran[0][0].endswith("cuda_12.8.1_windows_network.exe") and "nvcc_12.8" in ran[0]


def test_a_changed_installer_is_never_run(monkeypatch, tmp_path, installer_server):
    base, _ = installer_server
    ran: list = []
    with pytest.raises(CibwError, match="this is not the file that was pinned, and it was not run"):
        ran = _windows_install(monkeypatch, tmp_path, base, "ab" * 32)
    assert ran == []


def test_an_unpinned_installer_is_neither_downloaded_nor_run(monkeypatch, tmp_path):
    def no_download(*a, **kw):
        raise AssertionError("downloaded although no sha256 is pinned")

    monkeypatch.setattr(runner_setup, "download", no_download)
    with pytest.raises(CibwError, match=r"no sha256 pinned for the CUDA 12\.8\.1 Windows installer"):
        _windows_install(monkeypatch, tmp_path, "http://127.0.0.1:9", None)
    from ci.release.cibw import install_cuda_plan

    script = install_cuda_plan(BY_ID["windows-amd64-cu128-torch2.7"])
    assert "exit 1" in script and "curl" not in script


def test_the_toolset_gxx_is_found_in_the_packages_file_list(tmp_path, monkeypatch):
    """toolset_cxx asks rpm where the installed gcc-toolset put its g++ (a stand-in rpm on PATH
    answers as `rpm -ql` does); without the package it names the toolset, which nothing runs."""
    root = tmp_path / "gcc-toolset-13" / "root" / "usr"  # where the stand-in says the package lies
    rpm = tmp_path / "rpm"
    rpm.write_text("#!/bin/sh\n[ \"$1\" = -ql ] && [ \"$2\" = gcc-toolset-13-gcc-c++ ] || exit 1\n"
                   f"printf '%s\\n' {root}/bin/c++ {root}/bin/g++ {root}/share/man/man1/g++.1.gz\n")
    rpm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert runner_setup.toolset_cxx(13) == f"{root}/bin/g++"
    assert runner_setup.toolset_cxx(15) == "gcc-toolset-15-g++"
