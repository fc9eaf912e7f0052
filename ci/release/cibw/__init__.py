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
from pathlib import Path

from ci.release.cibw_job import nvcc_jobs
from ci.release.runner_setup import CibwError, cleanup_after_build
from ci.release.runner_setup import cuda_commands
from ci.release.runner_setup import install_cuda as _install_cuda
from ci.runtime.log import default_log
from ci.toolchain.targets import Matrix, Target
from ci.toolchain.torch_source import TorchSource, foreign_torch_source, torch_source
from ci.runtime.env import FactoryEnv, child_environ, python_override_var, set_environ, setdefault_environ
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


def _dist() -> Path:
    return Path(FactoryEnv.from_environ().dist or REPO / "dist")


# -- before-all ------------------------------------------------------------------------------

def install_cuda(target: Target, github_env: Path | None = None, log=default_log) -> None:
    """before-all: the target's CUDA toolkit (ci.release.runner_setup.install_cuda); none for the probe."""
    if probe_dir() is not None:
        cmds = cuda_commands(target)
        log(f"[cuda] probe payload: no toolkit installed (the payload's job runs {cmds or 'the PyPI provisioning'})")
        return
    _install_cuda(target, github_env, log=log)


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
    """The build stage for $SAGEATTN3_TARGET; the raw wheel is copied into ``wheel_dir``.
    ``$MAX_JOBS`` caps the parallel compiles (default: what this machine's memory holds);
    with ``$SAGEATTN3_CI_CLEANUP=1`` what only the build needed is removed afterwards."""
    from ci.stages.build import build
    from ci.stages.resolve import resolve_toolchain

    _container_pythons()
    matrix, target = load_target()
    if probe_dir() is not None:
        return build_probe(target, wheel_dir, log=log)
    given = FactoryEnv.from_environ().max_jobs
    jobs = given if given is not None else int(nvcc_jobs())
    log(f"[build] {target.id}: {jobs} parallel compiles; torch {torch_source(target).describe()}")
    started = time.time()
    try:
        result = build(resolve_toolchain(target, matrix), matrix, _dist() / "raw" / target.id, jobs=jobs, log=log)
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
    src = _dist() / "raw" / f"{target.id}.build.log"
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
    """repair (auditwheel/delvewheel, excludes) then tag (checks + record beside) into dest_dir."""
    from ci.stages.tag import tag
    from ci.stages.repair import repair

    _, target = load_target()
    repaired = repair(wheel, _dist() / "repaired" / target.id, target.os.platform, settings=FactoryEnv.from_environ(),
                      log=log)
    if probe_dir() is not None:  # no build record to tag by
        dest_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repaired, dest_dir / repaired.name)
        log(f"[repair] probe payload: {repaired.name}")
        return dest_dir / repaired.name
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
    probe = ("import os, sys; b = getattr(sys, '_base_executable', '') or sys.executable\n"
             "if sys.prefix != sys.base_prefix and os.name != 'nt': b = os.path.realpath(b)\n"
             "print('%d.%d' % sys.version_info[:2]); print(b)")
    try:
        out = subprocess.run([path, "-c", probe], capture_output=True, text=True, check=True, timeout=120).stdout.split("\n")
    except (OSError, subprocess.SubprocessError) as e:
        raise CibwError(f"--python-exe {path} did not run: {e}") from e
    version, base = out[0].strip(), out[1].strip()
    set_environ(python_override_var(version), base)
    return version, base


def verify_wheel(wheel: Path, pythons: list[str] | None = None, python_exe: str | None = None, log=default_log):
    """The verify stage on one repaired wheel, against an index of that wheel alone, with the
    target's own torch (the build's environment when the Python is the build's). ``python_exe``:
    the interpreter cibuildwheel tests with (the target's floor Python), passed explicitly so
    verify never has to find one."""
    from ci import index as indexmod
    from ci.stages.record import BuildRecord, read_record_in_wheel, record_path
    from ci.stages.resolve import verify_envs
    from ci.stages.verify import verify

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


# -- the probe payload -----------------------------------------------------------------------
# `nox -s cibuildwheel -- --payload probe` (and tests/test_cibw_local.py) run real cibuildwheel
# with ci/cibuildwheel.toml's hooks on a one-file C extension instead of sageattn3/: the same
# hook commands, container, environment and stages, in minutes. $SAGEATTN3_CIBW_PROBE names the
# probe project, relative to the project root; cibuildwheel passes it into its container.
PROBE_ENV = FactoryEnv.variable("cibw_probe")


def probe_dir() -> Path | None:
    rel = FactoryEnv.from_environ().cibw_probe
    if not rel:
        return None
    path = (REPO / rel).resolve()
    if not (path / "pyproject.toml").is_file():
        raise CibwError(f"${PROBE_ENV}={rel}: no pyproject.toml at {path}")
    return path


def build_probe(target: Target, wheel_dir: Path, log=default_log) -> Path:
    """The build stage on the probe: ``pip wheel`` with the Python cibuildwheel builds with
    (the shim's), abi3 for the target's floor."""
    from ci.toolchain.tools import find_python

    here = FactoryEnv.from_environ().build_python or target.python
    python = find_python(here)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    before = set(wheel_dir.glob("*.whl"))
    cmd = [str(python), "-m", "pip", "wheel", "--no-deps", "-w", str(wheel_dir), str(probe_dir())]
    log(f"[build] probe payload, Python {here}: {' '.join(cmd)}")
    from ci.runtime.pip_env import pip_environ

    subprocess.run(cmd, check=True, env=pip_environ(extra={"SAGEATTN3_PROBE_LIMITED_API": target.python_tag}))
    new = sorted(set(wheel_dir.glob("*.whl")) - before)
    if len(new) != 1 or f"-{target.python_tag}-abi3-" not in new[0].name:
        raise CibwError(f"the probe's build left {[w.name for w in new]}, expected one {target.python_tag}-abi3 wheel")
    return new[0]


def verify_probe(wheel: Path, target: Target, pythons: list[str], python_exe: str | None, log=default_log) -> str:
    """The verify stage on the probe: the test Python must be the target's floor, as for the
    payload; a fresh venv of it gets the wheel with its dependency, and the extension runs."""
    from ci.runtime.pip_env import pip_environ

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
        + " ".join(f"{k}={v}" for k, v in sorted(child_environ().items()) if k.startswith("PIP_")))
    return wheel.name


# -- CLI ------------------------------------------------------------------------------------
