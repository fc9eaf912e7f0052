"""A release runner made ready for the build, and tidied after it: the target's CUDA toolkit
installed (13.x from PyPI through the factory's provisioning, 12.x from NVIDIA's RHEL 8
repository on Linux at pinned versions with the gcc-toolset nvcc uses as host compiler,
NVIDIA's network installer on Windows, checked against its pinned sha256 before it runs), MSVC's x64 environment exported,
the runner's preinstalled software removed to free disk, and what only the build needed removed
before verify."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePath

from ci.runtime.log import default_log
from ci.toolchain.flags import CUDA12_GCC_TOOLSET, cuda_host_compiler, toolset_cxx  # noqa: F401 (re-exported)
from ci.toolchain.targets import Target
from ci.runtime.errors import FactoryError
from ci.runtime.env import FactoryEnv, child_environ

REPO = Path(__file__).resolve().parents[2]

# CUDA 12.x on Linux: NVIDIA's RHEL 8 repository (manylinux_2_28 is AlmaLinux 8). Only what
# compiling the payload needs: nvcc + crt, the runtime's headers/libs, CCCL, and the math
# libraries' headers that torch's CUDA headers include.
NVIDIA_RHEL8_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/rhel8/{arch}/cuda-rhel8.repo"


RHEL8_REPO_ARCH = {"x86_64": "x86_64", "aarch64": "sbsa"}


RPM_PACKAGES = ("cuda-nvcc", "cuda-cudart-devel", "cuda-cccl", "cuda-nvrtc-devel", "libcublas-devel",
                "libcusparse-devel", "libcusolver-devel", "libcurand-devel")


# The exact version of each of RPM_PACKAGES per CUDA major.minor: the components of the full
# release WINDOWS_CUDA_RELEASES names for it (the same release on both OSes), as NVIDIA numbers
# them in the release's redistributables (the same numbers as PyPI's nvidia-*-cu12 wheels of that
# release). dnf installs `<package>-<major>-<minor>-<version>-<RPM_RELEASE>`; a version the
# repository lacks fails the job at once ("No match for argument"), and after the install
# `rpm -q` must report exactly these (installed_rpm_problems). What they pull in (cuda-crt,
# cuda-nvvm, cuda-cudart, ...) follows from NVIDIA's dependencies of these packages.
RPM_VERSIONS = {
    "12.8": {"cuda-nvcc": "12.8.93", "cuda-cudart-devel": "12.8.90", "cuda-cccl": "12.8.90",
             "cuda-nvrtc-devel": "12.8.93", "libcublas-devel": "12.8.4.1", "libcusparse-devel": "12.5.8.93",
             "libcusolver-devel": "11.7.3.90", "libcurand-devel": "10.3.9.90"},
    "12.9": {"cuda-nvcc": "12.9.86", "cuda-cudart-devel": "12.9.79", "cuda-cccl": "12.9.27",
             "cuda-nvrtc-devel": "12.9.86", "libcublas-devel": "12.9.1.4", "libcusparse-devel": "12.5.10.65",
             "libcusolver-devel": "11.7.5.82", "libcurand-devel": "10.3.10.19"},
}


RPM_RELEASE = "1"




# The newest GCC major each CUDA 12.x accepts (its crt/host_config.h).
CUDA_MAX_GCC = {"12.8": 14, "12.9": 14}


# Windows: NVIDIA's network installer, silent, only the components named here. The full
# release each major.minor resolves to (update with the matrix; `check` RELEASING.md).
WINDOWS_CUDA_RELEASES = {"12.8": "12.8.1", "12.9": "12.9.1", "13.0": "13.0.2", "13.2": "13.2.0"}


WINDOWS_INSTALLER = "https://developer.download.nvidia.com/compute/cuda/{full}/network_installers/cuda_{full}_windows_network.exe"


# The sha256 of each release's WINDOWS_INSTALLER file, checked before it runs (check_sha256):
# a different file stops the job. Values as published by people who downloaded the installer
# from NVIDIA and checked its Authenticode signature (NVIDIA Corporation); 12.8.1 and 12.9.1 were
# each reported by two unrelated projects. None: not pinned yet, and the job refuses to run the
# installer (see RELEASING.md, "Pin a Windows CUDA installer").
WINDOWS_INSTALLER_SHA256: dict[str, str | None] = {
    "12.8.1": "779bee8ff557255c1cf5f36e0230f081675b9bb41e44be38839920cd5209bdeb",
    "12.9.1": "de45c336ab4e9825018b546357dc9de5ded9f89c4f5200ef52b8eeac3b1b4072",
    "13.0.2": "00c03dcc82007bc1c323c50d64bc2c25bdcffb1846a187889a3b86f6a3050841",
    "13.2.0": None,
}


# Component names as the installer's silent mode takes them (`-s nvcc_12.8 ...`), from NVIDIA's
# "CUDA Installation Guide for Microsoft Windows", table "Possible Subpackage Names"
# (docs.nvidia.com/cuda/cuda-installation-guide-microsoft-windows). Its CUDA 13.2 edition lists
# every name below with the _13.2 suffix, plus crt_13.2 and nvvm_13.2 as their own subpackages:
# CUDA 13 split nvcc's headers (crt) and its NVVM compiler out of nvcc, so without them nvcc
# 13.x cannot compile (crt/host_config.h missing). 12.x tables have neither (nvcc carries them).
# Public builds with the 13.0.2 network installer use nvcc/cudart/crt/nvvm_13.0 the same way.
# From 13.4 the installer is named cuda_<full>_windows_x86_64_network.exe: update
# WINDOWS_INSTALLER before adding a 13.4 entry.
WINDOWS_COMPONENTS = ("nvcc", "cudart", "nvrtc", "nvrtc_dev", "cublas_dev", "cusparse_dev", "cusolver_dev",
                      "curand_dev", "thrust", "visual_studio_integration")


WINDOWS_COMPONENTS_13 = ("crt", "nvvm")


# The installer download: per-read timeout, attempts, and the installer's own time limit.
DOWNLOAD_TIMEOUT_S = 60


DOWNLOAD_ATTEMPTS = 4


INSTALLER_TIMEOUT_S = 40 * 60


# Preinstalled software a build never uses, removed before building to free runner disk
# (a Linux job holds the manylinux image, CUDA and two torch environments at once).
RUNNER_BLOAT = {
    "linux": ("/usr/share/dotnet", "/usr/local/lib/android", "/opt/ghc", "/usr/local/.ghcup",
              "/opt/hostedtoolcache/CodeQL", "/usr/share/swift", "/usr/local/share/powershell"),
    # Windows deletes file by file, slowly (the Android SDK alone is hundreds of thousands of
    # files): best effort, within WINDOWS_DISK_BUDGET_S, the biggest first; what is left stays.
    "windows": (r"C:\Android", r"C:\hostedtoolcache\windows\CodeQL"),
}


# How long free-disk may delete on Windows (the step's limit is 20 minutes).
WINDOWS_DISK_BUDGET_S = 8 * 60


class CibwError(FactoryError, RuntimeError):
    pass


# -- before-all: the CUDA toolkit --------------------------------------------------------

def rpm_specs(cuda: str) -> list[str]:
    """The exact packages dnf installs for CUDA ``cuda`` (12.x): name-version-release."""
    versions = RPM_VERSIONS.get(cuda)
    major, minor = cuda.split(".")
    if not versions or set(versions) != set(RPM_PACKAGES):
        raise CibwError(f"no pinned RPM versions of {', '.join(RPM_PACKAGES)} for CUDA {cuda}: add them to "
                        f"RPM_VERSIONS in ci/release/runner_setup.py (the components of CUDA {WINDOWS_CUDA_RELEASES.get(cuda, cuda + '.x')})")
    return [f"{p}-{major}-{minor}-{versions[p]}-{RPM_RELEASE}" for p in RPM_PACKAGES]


def cuda_commands(target: Target) -> list[list[str]]:
    """The commands that install the target's CUDA toolkit where the factory finds it
    (13.x: none here; the build provisions it from PyPI into its cache); on a CUDA 12.x Linux
    target also the gcc-toolset nvcc compiles host code with (cuda_host_compiler)."""
    major, minor = target.cuda.split(".")
    if int(major) >= 13 and target.os.platform == "linux":
        return []
    if target.os.platform == "linux":
        repo = NVIDIA_RHEL8_REPO.format(arch=RHEL8_REPO_ARCH[target.os.machine])
        return [["dnf", "install", "-y", "dnf-plugins-core"],
                ["dnf", "install", "-y", "--setopt=install_weak_deps=False", f"gcc-toolset-{CUDA12_GCC_TOOLSET}-gcc-c++"],
                ["dnf", "config-manager", "--add-repo", repo],
                ["dnf", "install", "-y", "--setopt=install_weak_deps=False", *rpm_specs(target.cuda)]]
    full = WINDOWS_CUDA_RELEASES.get(target.cuda)
    if not full:
        raise CibwError(f"no Windows CUDA installer release known for CUDA {target.cuda}: add it to "
                        f"WINDOWS_CUDA_RELEASES in ci/release/runner_setup.py")
    comps = WINDOWS_COMPONENTS + (WINDOWS_COMPONENTS_13 if int(major) >= 13 else ())
    return [["<installer>", "-s", *[f"{c}_{target.cuda}" for c in comps]]]


def shell_script(cmds: list[list[str]]) -> str:
    """``cmds`` as the bash script they amount to (``install-cuda --dry-run`` prints it)."""
    import shlex

    return "set -euo pipefail\n" + "".join(shlex.join(c) + "\n" for c in cmds)


# -- checks of what was downloaded or installed ----------------------------------------------

def sha256_of(path: Path) -> str:
    from ci.stages.record import sha256_of as file_sha256

    return file_sha256(path)


def pinned_installer_sha256(full: str) -> str:
    """The pinned sha256 of CUDA ``full``'s Windows installer; CibwError when there is none."""
    want = WINDOWS_INSTALLER_SHA256.get(full)
    if not want:
        raise CibwError(
            f"no sha256 pinned for the CUDA {full} Windows installer ({WINDOWS_INSTALLER.format(full=full)}): "
            f"the job runs no unchecked installer. On a machine with access, download it, check that its "
            f"Authenticode signer is NVIDIA Corporation and its md5 is the one in NVIDIA's "
            f"https://developer.download.nvidia.com/compute/cuda/{full}/docs/sidebar/md5sum.txt, and add its "
            f"sha256 to WINDOWS_INSTALLER_SHA256 in ci/release/runner_setup.py")
    return want


def check_sha256(path: Path, want: str, what: str) -> str:
    """``path``'s sha256 must be ``want`` (CibwError naming both otherwise); returns it."""
    got = sha256_of(path)
    if got != want.lower():
        raise CibwError(f"{what}: sha256 {got}, but ci/release/runner_setup.py pins {want}: this is not the file that was "
                        f"pinned, and it was not run. If NVIDIA re-issued it, check the new file's signature and md5 "
                        f"(NVIDIA's md5sum.txt of the release) before pinning its sha256 in WINDOWS_INSTALLER_SHA256")
    return got


def installed_rpm_problems(rpm_query: str, cuda: str) -> list[str]:
    """Compare ``rpm -q --qf '%{NAME} %{VERSION}-%{RELEASE}\\n' <names>``'s output with the pins of
    CUDA ``cuda``; empty: every pinned package is installed at exactly its version."""
    major, minor = cuda.split(".")
    want = {f"{p}-{major}-{minor}": f"{v}-{RPM_RELEASE}" for p, v in RPM_VERSIONS[cuda].items()}
    got: dict[str, str] = {}
    for line in rpm_query.splitlines():
        parts = line.split()
        if len(parts) == 2:
            got[parts[0]] = parts[1]
    return [f"{name}: {'not installed' if name not in got else 'installed ' + got[name]}, pinned {ver}"
            for name, ver in sorted(want.items()) if got.get(name) != ver]


def check_host_compiler(cxx: str, cuda: str, *, toolset: int = CUDA12_GCC_TOOLSET) -> str:
    """``cxx`` (the gcc-toolset's g++) must run and be GCC ``toolset``, which CUDA ``cuda``
    accepts (CUDA_MAX_GCC); returns its version."""
    try:
        version = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise CibwError(f"nvcc's host compiler {cxx} did not run ({e}): before-all installs it "
                        f"(dnf install gcc-toolset-{toolset}-gcc-c++)") from e
    major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else -1
    limit = CUDA_MAX_GCC.get(cuda)
    if major != toolset:
        raise CibwError(f"{cxx} is GCC {version or '?'}, expected gcc-toolset-{toolset} (CUDA12_GCC_TOOLSET in "
                        f"ci/release/runner_setup.py)")
    if limit is None or major > limit:
        raise CibwError(f"{cxx} is GCC {version}; CUDA {cuda} accepts GCC up to {limit or '? (add it to CUDA_MAX_GCC)'}")
    return version


def download(url: str, dest: Path, *, timeout: float = DOWNLOAD_TIMEOUT_S, attempts: int = DOWNLOAD_ATTEMPTS,
             log=default_log) -> Path:
    """``url`` into ``dest``: each read times out after ``timeout`` s (a stalled connection fails
    instead of hanging the job), retried with backoff; a partial file never remains."""
    for attempt in range(1, attempts + 1):
        part = dest.with_name(dest.name + ".part")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp, open(part, "wb") as out:  # noqa: S310
                shutil.copyfileobj(resp, out, 1 << 20)
            part.replace(dest)
            return dest
        except (urllib.error.URLError, OSError) as e:
            part.unlink(missing_ok=True)
            if attempt == attempts:
                raise CibwError(f"could not download {url} after {attempts} attempts: {e}") from e
            wait = 5 * 2 ** (attempt - 1)
            log(f"[cuda] download failed ({e}); attempt {attempt + 1}/{attempts} in {wait}s")
            time.sleep(wait)
    raise AssertionError("unreachable")


def install_cuda(target: Target, github_env: Path | None = None, log=default_log) -> None:
    """The commands of ``cuda_commands`` run (Windows: the installer downloaded first), then the
    toolkit found where the factory looks for it (13.x: provisioned from PyPI)."""
    from ci.toolchain.tools import find_cuda

    cmds = cuda_commands(target)
    if target.os.platform == "windows" and cmds:
        full = WINDOWS_CUDA_RELEASES[target.cuda]
        want = pinned_installer_sha256(full)  # before any download: no pin, no installer
        with tempfile.TemporaryDirectory() as tmp:
            exe = Path(tmp) / f"cuda_{full}_windows_network.exe"
            url = WINDOWS_INSTALLER.format(full=full)
            log(f"[cuda] downloading NVIDIA's CUDA {full} network installer")
            download(url, exe, log=log)
            check_sha256(exe, want, f"the CUDA {full} installer from {url}")
            log(f"[cuda] {exe.name}: sha256 {want} (pinned)")
            try:
                subprocess.run([str(exe), *cmds[0][1:]], check=True, timeout=INSTALLER_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                raise CibwError(f"the CUDA {full} installer ran over {INSTALLER_TIMEOUT_S // 60} minutes") from e
        home = Path(FactoryEnv.from_environ().program_files) / "NVIDIA GPU Computing Toolkit" / "CUDA" / f"v{target.cuda}"
        if not (home / "bin" / "nvcc.exe").exists():
            raise CibwError(f"CUDA {target.cuda} installer finished but {home}\\bin\\nvcc.exe is missing")
        if github_env:
            with open(github_env, "a", encoding="utf-8") as f:
                f.write(f"CUDA_HOME={home}\nCUDA_PATH={home}\n")
            gh_path = FactoryEnv.from_environ().github_path
            if gh_path:
                with open(gh_path, "a", encoding="utf-8") as f:
                    f.write(f"{home / 'bin'}\n")
        log(f"[cuda] CUDA {target.cuda} at {home}")
        return
    for cmd in cmds:
        log(f"[cuda] {' '.join(cmd)}")
        subprocess.run(cmd, check=True)
    if cmds:  # NVIDIA's packages: exactly the pinned versions, and nvcc's host compiler
        major, minor = target.cuda.split(".")
        names = [f"{p}-{major}-{minor}" for p in RPM_PACKAGES]
        query = subprocess.run(["rpm", "-q", "--qf", "%{NAME} %{VERSION}-%{RELEASE}\\n", *names],
                               capture_output=True, text=True).stdout
        problems = installed_rpm_problems(query, target.cuda)
        if problems:
            raise CibwError(f"CUDA {target.cuda}'s packages are not the pinned ones (RPM_VERSIONS in "
                            f"ci/release/runner_setup.py): {'; '.join(problems)}")
        cxx = cuda_host_compiler(target)
        log(f"[cuda] nvcc's host compiler: {cxx}, GCC {check_host_compiler(cxx, target.cuda)}")
    tk = find_cuda(target.cuda)  # 13.x: provisions from PyPI into the factory's cache now
    log(f"[cuda] CUDA {tk.version} ({tk.source}) at {tk.home}")


def msvc_env(vswhere: Path | None = None) -> dict[str, str]:
    """The variables vcvars64 sets for the VS 2022 x64 toolset (nvcc needs cl.exe on PATH)."""
    vswhere = vswhere or Path(FactoryEnv.from_environ().program_files_x86) / "Microsoft Visual Studio" / "Installer" / "vswhere.exe"
    root = subprocess.run([str(vswhere), "-latest", "-products", "*", "-version", "[17.0,18.0)", "-requires",
                           "Microsoft.VisualStudio.Component.VC.Tools.x86.x64", "-property", "installationPath"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if not root:
        raise CibwError("Visual Studio 2022 with the C++ x64 toolset not found (vswhere); the release uses windows-2022")
    bat = Path(root) / "VC" / "Auxiliary" / "Build" / "vcvars64.bat"
    out = subprocess.run(f'cmd /s /c ""{bat}" >nul && set"', capture_output=True, text=True, shell=True, check=True).stdout
    return env_diff(child_environ(), out)


def env_diff(before: dict[str, str], set_output: str) -> dict[str, str]:
    """What ``set`` printed that differs from ``before`` (keys compared case-insensitively)."""
    old = {k.upper(): v for k, v in before.items()}
    changed = {}
    for line in set_output.splitlines():
        k, sep, v = line.partition("=")
        if sep and k and old.get(k.upper()) != v:
            changed[k] = v
    return changed


# -- disk: before the build and between build and verify --------------------------------

def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def cleanup_after_build(target: Target, *, keep: list[Path] = (), cache: Path | None = None,
                        stage: Path | None = None, purge_pip: bool = True, log=default_log) -> dict[str, int]:
    """Remove what only the build needed, before verify installs its own torch: the factory's
    CUDA toolkits, CUTLASS headers and torch environments (except ``keep``: the build's, when
    verify reuses it), the staging copies, pip's download cache, and in a manylinux container
    the CUDA 12.x toolkit from NVIDIA's repository. The compiler cache stays (the job saves it).
    Returns the bytes freed per path."""
    from ci.toolchain.tools import cache_root

    cache = cache or cache_root()
    keep_resolved = {Path(k).resolve() for k in keep}
    doomed = [cache / "cuda", cache / "cutlass"]
    envs = cache / "envs"
    if envs.is_dir():
        doomed += [e for e in sorted(envs.iterdir()) if e.resolve() not in keep_resolved]
    doomed.append(stage or REPO / "build" / "stage")
    in_container = Path("/opt/python").is_dir() and hasattr(os, "geteuid") and os.geteuid() == 0
    if in_container and int(target.cuda.split(".")[0]) < 13:
        doomed.append(Path(f"/usr/local/cuda-{target.cuda}"))
    freed: dict[str, int] = {}
    for path in doomed:
        if not path.exists():
            continue
        size = _size(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        freed[str(path)] = size
    if purge_pip:
        subprocess.run([sys.executable, "-m", "pip", "cache", "purge"], capture_output=True)
    total = sum(freed.values())
    log(f"[cleanup] removed {len(freed)} build-only paths, {total / 2**30:.1f} GiB"
        + (f"; kept {', '.join(str(k) for k in keep)}" if keep else ""))
    return freed


def _remove_within(path: str, deadline: float) -> bool:
    """Delete ``path`` file by file until ``deadline`` (time.monotonic()); errors are skipped
    (read-only files are made writable first). True when it is gone."""
    def unlink(p: str) -> None:
        try:
            os.unlink(p)
        except PermissionError:
            try:
                os.chmod(p, stat.S_IWRITE)
                os.unlink(p)
            except OSError:
                pass
        except OSError:
            pass

    if os.path.islink(path) or os.path.isfile(path):
        unlink(path)
        return not os.path.lexists(path)
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            if time.monotonic() > deadline:
                return False
            unlink(os.path.join(root, name))
        for name in dirs:
            d = os.path.join(root, name)
            try:
                os.unlink(d) if os.path.islink(d) else os.rmdir(d)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass
    return not os.path.lexists(path)


def _drive(path: str, flavour: type[PurePath] = Path) -> str:
    """The drive (Windows: ``C:\\``) or root a path is on, as disk_usage takes it."""
    return flavour(path).anchor or os.sep


def free_disk(paths: tuple[str, ...] | None = None, *, platform: str | None = None, use_sudo: bool | None = None,
              budget_s: float | None = None, log=default_log) -> int:
    """Remove the runner's preinstalled software that no build uses (``RUNNER_BLOAT`` for this
    OS); returns the bytes the disk(s) gained, and reports the free space of each drive it
    deleted from. Linux: ``sudo rm -rf`` (``use_sudo``: default when not root and sudo exists).
    Windows: best effort within ``budget_s`` (default WINDOWS_DISK_BUDGET_S), never an error."""
    platform = platform or ("windows" if sys.platform == "win32" else "linux")
    paths = RUNNER_BLOAT[platform] if paths is None else paths
    present = [p for p in paths if os.path.lexists(p)]
    if not present:
        log(f"[disk] nothing to remove ({', '.join(paths) or 'no paths'} absent)")
        return 0
    drives = sorted({_drive(p) for p in present})
    before = {d: shutil.disk_usage(d).free for d in drives}
    if platform == "windows":
        budget = WINDOWS_DISK_BUDGET_S if budget_s is None else budget_s
        deadline = time.monotonic() + budget
        for p in present:
            if not _remove_within(p, deadline):
                log(f"[disk] stopped at the {budget:.0f}s budget (best effort): {p} partly removed, "
                    f"{', '.join(q for q in present[present.index(p) + 1:]) or 'nothing else'} left")
                break
    else:
        if use_sudo is None:
            use_sudo = os.geteuid() != 0 and bool(shutil.which("sudo"))
        for p in present:
            if use_sudo:
                subprocess.run(["sudo", "-n", "rm", "-rf", p], check=False)
            else:
                shutil.rmtree(p, ignore_errors=True)
    gained = 0
    for d in drives:
        after = shutil.disk_usage(d).free
        gained += after - before[d]
        log(f"[disk] {d}: {before[d] / 2**30:.1f} GiB free before, {after / 2**30:.1f} GiB after "
            f"(removed from it: {', '.join(p for p in present if _drive(p) == d)})")
    return gained
