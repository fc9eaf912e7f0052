"""cibuildwheel's hooks into the factory: the release pipeline builds every wheel with
cibuildwheel (manylinux_2_28 containers on Linux, the windows-2022 runner on Windows), and each
of cibuildwheel's steps calls one factory stage, so the build is never reimplemented in YAML:

    before-all      install-cuda   CUDA 13.x from PyPI (the factory's provisioning); 12.x from
                                   NVIDIA's package repository at pinned versions, with the
                                   gcc-toolset nvcc compiles host code with (Linux), or NVIDIA's
                                   installer, checked against its pinned sha256 (Windows)
    build           build          ci.stages.build.build (staging copy, patches, flag profile, compile),
                                   reached through the PEP 517 shim in ci/release/cibw_project/
    repair-command  repair         ci.stages.repair.repair (auditwheel / delvewheel with the torch and
                                   CUDA excludes) then ci.stages.tag.tag (label, abi3, torch range)
    test-command    verify         ci.stages.verify.verify (fresh venvs, real pip over HTTP, ABI guard)
    (after)         collect        the tagged wheel + its build record into dist/wheels

The factory itself needs Python >= 3.11, while cibuildwheel's build Python is the target's
(3.9/3.10): every hook runs under ``$SAGEATTN3_FACTORY_PYTHON`` (cp312 in the manylinux image,
the runner's setup-python on Windows), the same way a local ``nox -s build-wheels`` runs the
factory on one Python and compiles with another. The target is ``$SAGEATTN3_TARGET``.

Each hook finds its target, then runs its stage from one :class:`Stages` value: the factory's
(:data:`FACTORY_STAGES`, the stages above) unless ``$SAGEATTN3_CIBW_PAYLOAD`` names another
payload project, a directory relative to the project root holding a ``cibw_stages.py`` whose
``STAGES`` the hooks run instead (loaded from its file: see :func:`stages`).

``python -m ci.release.cibw env --target ID`` prints the environment a release job exports for a target
(the cibuildwheel build selector among it); tests check that cibuildwheel, given it, selects
exactly that target's one build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ci.release.cibw_job import nvcc_jobs
from ci.release.runner_setup import CibwError, cleanup_after_build
from ci.release.runner_setup import cuda_commands
from ci.release.runner_setup import install_cuda as _install_cuda
from ci.payload.interface import load
from ci.runtime.log import default_log
from ci.toolchain.targets import Matrix, Target
from ci.toolchain.torch_source import TorchSource, foreign_torch_source, torch_source
from ci.runtime.env import FactoryEnv, python_override_var, set_environ, setdefault_environ
from ci.runtime.errors import InputError

REPO = Path(__file__).resolve().parents[3]


def load_target(target_id: str | None = None) -> tuple[Matrix, Target]:
    tid = target_id or FactoryEnv.from_environ().target
    if not tid:
        raise InputError("no target: pass --target ID or set SAGEATTN3_TARGET")
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
        setdefault_environ(f"SAGEATTN3_PYTHON_3_{minor}", str(d / "bin" / "python"))


def dist_dir() -> Path:
    """The output root of the hooks: ``$SAGEATTN3_DIST``, else ``dist/``."""
    return Path(FactoryEnv.from_environ().dist or REPO / "dist")


# -- before-all ------------------------------------------------------------------------------

def install_cuda(target: Target, github_env: Path | None = None, log=default_log) -> None:
    """before-all: the stages' toolkit (the factory's: ci.release.runner_setup.install_cuda)."""
    stages().install_cuda(target, github_env, log=log)


def install_cuda_plan(target: Target) -> str:
    """What ``install-cuda`` runs for ``target``, as a bash script (Linux: the dnf commands, then
    the checks of what they installed; Windows: the pinned download and check, then the installer)."""
    from ci.release.runner_setup import (CUDA12_GCC_TOOLSET, RPM_PACKAGES, WINDOWS_CUDA_RELEASES, WINDOWS_INSTALLER,
                                 WINDOWS_INSTALLER_SHA256, shell_script)

    cmds = cuda_commands(target)
    if target.os.platform == "windows":
        full = WINDOWS_CUDA_RELEASES[target.cuda]
        exe = f"cuda_{full}_windows_network.exe"
        pin = WINDOWS_INSTALLER_SHA256.get(full)
        if not pin:  # the job stops before downloading (ci.release.runner_setup.pinned_installer_sha256)
            return shell_script([["echo", f"no sha256 pinned for {exe} (WINDOWS_INSTALLER_SHA256): nothing is run"],
                                 ["exit", "1"]])
        return (shell_script([["curl", "-fL", "-o", exe, WINDOWS_INSTALLER.format(full=full)]])
                + f"echo '{pin}  {exe}' | sha256sum --check --strict -\n"
                + shell_script([[f"./{exe}", *cmds[0][1:]]]).split("\n", 1)[1])
    if not cmds:
        return f"# CUDA {target.cuda}: provisioned from PyPI by the build (ci.toolchain.tools), nothing installed here\n"
    major, minor = target.cuda.split(".")
    checks = [["rpm", "-q", "--qf", "%{NAME} %{VERSION}-%{RELEASE}\\n", *[f"{p}-{major}-{minor}" for p in RPM_PACKAGES]]]
    # the toolset's g++ where the image installed it (ci.toolchain.flags.toolset_cxx, run time)
    cxx = f"$(rpm -ql gcc-toolset-{CUDA12_GCC_TOOLSET}-gcc-c++ | grep '/bin/g++$')"
    return shell_script(cmds) + f"# then: the installed versions are the pins, and the toolset's g++ is GCC {CUDA12_GCC_TOOLSET}\n" + \
        shell_script(checks).split("\n", 1)[1] + f'"{cxx}" -dumpfullversion -dumpversion\n'


# -- the stages cibuildwheel calls ----------------------------------------------------------

def build_into(wheel_dir: Path, log=default_log) -> Path:
    """The build stage for $SAGEATTN3_TARGET; the raw wheel is left in ``wheel_dir``."""
    _container_pythons()
    matrix, target = load_target()
    return stages().build(matrix, target, wheel_dir, log=log)


def build_sageattn3(matrix: Matrix, target: Target, wheel_dir: Path, log=default_log) -> Path:
    """The factory's build stage (ci.stages.build.build); the raw wheel is copied into ``wheel_dir``.
    ``$MAX_JOBS`` caps the parallel compiles (default: what this machine's memory holds);
    with ``$SAGEATTN3_CI_CLEANUP=1`` what only the build needed is removed afterwards."""
    from ci.stages.build import build
    from ci.stages.resolve import resolve_toolchain

    given = FactoryEnv.from_environ().max_jobs
    jobs = given if given is not None else int(nvcc_jobs())
    log(f"[build] {target.id}: {jobs} parallel compiles; torch {torch_source(target).describe()}")
    started = time.time()
    try:
        result = build(resolve_toolchain(target, matrix), matrix, dist_dir() / "raw" / target.id, jobs=jobs, log=log)
    finally:
        keep_build_log(target, since=started, log=log)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    out = wheel_dir / result.wheel.name
    shutil.copy2(result.wheel, out)
    if FactoryEnv.from_environ().ci_cleanup:
        verify_pythons = _verify_pythons(target)
        keep = [result.env.root] if result.env.python_version in verify_pythons else []
        cleanup_after_build(target, keep=keep, log=log)
    return out


# Where the build stage leaves a copy of its full log (the job uploads it when a step failed;
# the error itself shows only the last lines). In a manylinux container it is a host path.
LOG_DIR_ENV = FactoryEnv.variable("log_dir")


def keep_build_log(target: Target, *, since: float = 0.0, log_dir: Path | None = None, log=default_log) -> Path | None:
    """The build's full log (``dist/raw/<target>.build.log``, written by ci.stages.build) copied into
    ``$SAGEATTN3_LOG_DIR`` (or ``log_dir``), when this build (modified at or after ``since``)
    wrote one; returns the copy."""
    dest_dir = log_dir or FactoryEnv.from_environ().log_dir
    src = dist_dir() / "raw" / f"{target.id}.build.log"
    if dest_dir is None or not src.is_file() or src.stat().st_mtime < since:
        return None
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    shutil.copyfile(src, dest)
    log(f"[build] full log: {dest}")
    return dest


def _verify_pythons(target: Target, pythons: list[str] | None = None) -> list[str]:
    given = FactoryEnv.from_environ().verify_pythons
    return pythons or (list(given) if given is not None else target.python.split())


def repair_into(wheel: Path, dest_dir: Path, log=default_log) -> Path:
    """The repair stage for $SAGEATTN3_TARGET: the repaired wheel into ``dest_dir``."""
    _, target = load_target()
    return stages().repair(target, wheel, dest_dir, log=log)


def repair_and_tag(target: Target, wheel: Path, dest_dir: Path, log=default_log) -> Path:
    """The factory's repair stage: repair (auditwheel/delvewheel, excludes) then tag (checks +
    record beside) into dest_dir."""
    from ci.stages.tag import tag
    from ci.stages.repair import repair

    repaired = repair(wheel, dist_dir() / "repaired" / target.id, target.os.platform,
                      settings=FactoryEnv.from_environ(), log=log)
    rec = tag(repaired, target, dest_dir)
    log(f"[repair] {rec.wheel} sha256 {rec.sha256}")
    return dest_dir / rec.wheel


FOREIGN_DIR_ENV = FactoryEnv.variable("foreign_torch_dir")


def verify_sources(target: Target, matrix: Matrix, python: str) -> tuple[TorchSource, TorchSource]:
    """The torch verify installs (the build's: same source) and the foreign torch of the ABI
    guard check: a CPU build from PyTorch's ``cpu`` directory, or ``$SAGEATTN3_FOREIGN_TORCH_DIR``
    where an index has no CPU builds (the local rehearsal's stand-in)."""
    return (torch_source(target),
            foreign_torch_source(target, matrix, python, directory=FactoryEnv.from_environ().foreign_torch_dir or "cpu"))


def use_python(exe: str) -> tuple[str, str]:
    """Make ``exe`` (a path, or a name on PATH such as the ``python`` of cibuildwheel's test
    environment) the factory's interpreter for its version: ``$SAGEATTN3_PYTHON_X_Y`` is set to
    its base interpreter (what the build shim sets for the build, so verify makes its
    environments from the same Python). Returns (version, base interpreter)."""
    path = exe if (os.sep in exe or (os.altsep and os.altsep in exe)) else shutil.which(exe)
    if not path or not os.path.isfile(path):
        raise CibwError(f"--python-exe {exe}: no such interpreter (a path, or a name on PATH)")
    # the base interpreter: _base_executable (Windows venvs), resolved through a POSIX venv's symlink
    query = ("import os, sys; b = getattr(sys, '_base_executable', '') or sys.executable\n"
             "if sys.prefix != sys.base_prefix and os.name != 'nt': b = os.path.realpath(b)\n"
             "print('%d.%d' % sys.version_info[:2]); print(b)")
    try:
        out = subprocess.run([path, "-c", query], capture_output=True, text=True, check=True, timeout=120).stdout.split("\n")
    except (OSError, subprocess.SubprocessError) as e:
        raise CibwError(f"--python-exe {path} did not run: {e}") from e
    version, base = out[0].strip(), out[1].strip()
    set_environ(python_override_var(version), base)
    return version, base


def verify_wheel(wheel: Path, pythons: list[str] | None = None, python_exe: str | None = None, log=default_log):
    """The verify stage on one repaired wheel for $SAGEATTN3_TARGET, in ``pythons`` (default:
    ``$SAGEATTN3_VERIFY_PYTHONS``, else the target's). ``python_exe``: the interpreter cibuildwheel
    tests with (the target's floor Python), passed explicitly so verify never has to find one."""
    _container_pythons()
    matrix, target = load_target()
    return stages().verify(matrix, target, wheel, _verify_pythons(target, pythons), python_exe, log=log)


def verify_sageattn3(matrix: Matrix, target: Target, wheel: Path, pythons: list[str], python_exe: str | None,
                     log=default_log):
    """The factory's verify stage: against an index of the wheel alone, with the target's own
    torch (the build's environment when the Python is the build's)."""
    from ci import index as indexmod
    from ci.stages.record import BuildRecord, read_record_in_wheel, record_path
    from ci.stages.resolve import verify_envs
    from ci.stages.verify import verify

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
        envs = verify_envs(rec, pythons, torch_spec=source, foreign_torch=foreign, log=log)
        report = verify(rec, Path(tmp) / "index", envs, log=log)
    log(f"[verify] {report.wheel}: Python {', '.join(report.pythons)}; ABI guard: {report.abi_guard}")
    return report


def collect(wheelhouse: Path, out: Path, target_id: str | None = None, log=default_log) -> list[Path]:
    """cibuildwheel's output (wheels only) -> ``out`` with each wheel's build record beside it
    (the tag stage again: idempotent, and it re-checks what cibuildwheel moved)."""
    from ci.stages.tag import tag

    _, target = load_target(target_id)
    wheels = sorted(wheelhouse.glob("*.whl"))
    if len(wheels) != 1:
        raise CibwError(f"{wheelhouse}: expected the one wheel of {target.id}, found {[w.name for w in wheels]}")
    rec = tag(wheels[0], target, out)
    log(f"[collect] {out / rec.wheel} (+ .json)")
    return [out / rec.wheel]


# -- the stages a payload runs ---------------------------------------------------------------

@dataclass(frozen=True)
class Stages:
    """The stage each hook runs once it has found its target (``log`` by keyword):

        install_cuda(target, github_env, log=)                        before-all
        build(matrix, target, wheel_dir, log=) -> Path                build: one raw wheel in wheel_dir
        repair(target, wheel, dest_dir, log=) -> Path                 repair-wheel-command: the wheel in dest_dir
        verify(matrix, target, wheel, pythons, python_exe, log=)      test-command (pythons: those to verify in)

    A payload project's ``cibw_stages.py`` defines ``STAGES``, e.g. ``dataclasses.replace(
    FACTORY_STAGES, build=...)`` to replace only some."""

    install_cuda: Callable[..., None]
    build: Callable[..., Path]
    repair: Callable[..., Path]
    verify: Callable[..., object]


FACTORY_STAGES = Stages(install_cuda=_install_cuda, build=build_sageattn3, repair=repair_and_tag,
                        verify=verify_sageattn3)

# $SAGEATTN3_CIBW_PAYLOAD: another payload project, relative to the project root (cibuildwheel
# passes it into its container; ci.release.cibw_local sets it), holding a STAGES_FILE.
PAYLOAD_ENV = FactoryEnv.variable("cibw_payload")
STAGES_FILE = "cibw_stages.py"


def stages() -> Stages:
    """The stages the hooks run: $SAGEATTN3_CIBW_PAYLOAD's ``cibw_stages.py``'s ``STAGES``, else the
    factory's. The file is loaded by its path, never imported as a package of this project."""
    rel = FactoryEnv.from_environ().cibw_payload
    if not rel:
        return FACTORY_STAGES
    path = (REPO / rel / STAGES_FILE).resolve()
    if not path.is_relative_to(REPO.resolve()):
        raise CibwError(f"${PAYLOAD_ENV}={rel}: a payload project lies inside the project ({REPO}), "
                        "the folder cibuildwheel copies into its container")
    return _stages_in(path, rel)


@cache
def _stages_in(path: Path, rel: str) -> Stages:
    if not path.is_file():
        raise CibwError(f"${PAYLOAD_ENV}={rel}: no {STAGES_FILE} at {path}")
    got = getattr(load(path, "sageattn3_cibw_stages"), "STAGES", None)
    if not isinstance(got, Stages):
        raise CibwError(f"{path}: STAGES is {type(got).__name__}, not a ci.release.cibw.Stages")
    return got


# -- CLI ------------------------------------------------------------------------------------
