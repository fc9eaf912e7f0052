"""The pinned cibuildwheel, for real, on a Linux target here (``nox -s cibuildwheel``).

What build-target.yml's cibuildwheel step runs, on this machine: ``python -m cibuildwheel
--config-file ci/cibuildwheel.toml --output-dir OUT ci/release/cibw_project`` with the job's environment
(``python -m ci.release.cibw env --target ID``), so cibuildwheel itself creates the container, copies
the project in, and runs before-all, the build (the shim -> ``ci/release/cibw/__main__.py build``), the
repair-wheel-command, its abi3 audit, and the test-command with the toml's test-environment.
Only what this machine lacks is replaced, through cibuildwheel's own variables:

    CIBW_MANYLINUX_*_IMAGE   the stand-in image (ci/release/standin_image/; no registry is reachable)
    CIBW_CONTAINER_ENGINE    podman with runc (crun refuses this host's cgroups), explicit
                             ulimits (root here cannot raise rlimits), and host networking (the
                             stand-in for PyTorch's index listens on the host's 127.0.0.1)
    CIBW_DEPENDENCY_VERSIONS latest (the bundled pins name pip/certifi releases the mirror lacks)
    SAGEATTN3_PYTORCH_INDEX  the stand-in for PyTorch's index (ci.release.standin.pytorch_index_standin),
                             holding PyPI's wheels of the target's build torch and guard torch
    CIBW_ENVIRONMENT_PASS_LINUX  the toml's list (as cibuildwheel reads it) plus
                             SAGEATTN3_FOREIGN_TORCH_DIR: the stand-in has no CPU builds, so the
                             ABI guard's torch comes from the directory it does serve
    cibuildwheel's cache     virtualenv-<version>.pyz pre-seeded (its audit step would download
                             it from GitHub), made from PyPI's virtualenv wheel of that version
    SAGEATTN3_CI_CLEANUP     0: the container reaches this machine's cache through /host, and a
                             developer machine keeps its toolkits and torch environments (a
                             runner's job removes them before verify, to free its disk)
    SAGEATTN3_VERIFY_PYTHONS the Pythons verify installs the wheel into, when asked for more than
                             the target's floor (the dry run's ``--verify-python``)

``--payload-dir DIR`` runs another payload project's stages instead of the factory's on
sageattn3/: DIR, inside the repository (cibuildwheel copies the repository into its container),
holds a ``cibw_stages.py`` (``SAGEATTN3_CIBW_PAYLOAD``, passed into the container like
SAGEATTN3_FOREIGN_TORCH_DIR; see ci.release.cibw's Stages). tests/cibw_probe/ is one: a one-file
C extension, so the same hooks run in minutes, without CUDA or torch (and no stand-in torch is
stocked for it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from ci.runtime.errors import FactoryError
from ci.runtime.env import child_environ
from ci.runtime.log import default_log

REPO = Path(__file__).resolve().parents[3]
CONTAINER_ENGINE = ("podman; create_args: --runtime=runc --ulimit=nofile=20000:20000 "
                    "--ulimit=nproc=32768:32768 --network=host")


class LocalCibwError(FactoryError, RuntimeError):
    pass


@dataclass
class LocalRun:
    target: str
    command: list[str]
    env: dict[str, str]
    output_dir: Path
    log: Path
    seconds: float = 0.0
    wheels: tuple[Path, ...] = ()
    returncode: int | None = None

    def step_seconds(self) -> dict[str, float]:
        """How long each of cibuildwheel's steps took, as its log says (``✓ 12.34s`` under the
        step's title): before-all, build, repair, audit, test."""
        return step_seconds(self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else "")

    def lines(self, prefix: str) -> list[str]:
        """The lines of cibuildwheel's log a factory stage wrote with ``prefix`` (``[verify]``)."""
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""
        return [ln.strip() for ln in text.splitlines() if ln.strip().startswith(prefix)]


# cibuildwheel's step titles (its log), and the hook each one runs
STEP_TITLES = {"Running before_all...": "before-all", "Building wheel...": "build", "Repairing wheel...": "repair",
               "Auditing wheel...": "audit", "Testing wheel...": "test"}


def step_seconds(log_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    step = None
    for line in log_text.splitlines():
        if line in STEP_TITLES:
            step = STEP_TITLES[line]
        elif step and line.strip().startswith("✓ ") and line.strip().endswith("s"):
            try:
                out[step] = float(line.strip()[2:-1])
            except ValueError:
                pass
            step = None
    return out


def cibuildwheel_cache() -> Path:
    """cibuildwheel's cache folder ($CIBW_CACHE_PATH, else its platformdirs default)."""
    from ci.release.cibw_job import cibuildwheel_modules

    cibuildwheel_modules()
    from cibuildwheel.util.file import CIBW_CACHE_PATH

    return Path(CIBW_CACHE_PATH)


def seed_virtualenv_pyz(log=default_log) -> Path:
    """The ``virtualenv-<version>.pyz`` cibuildwheel's audit step runs, made here from PyPI's
    virtualenv wheel of the version cibuildwheel names (its resources/virtualenv.toml), as a
    zipapp, into cibuildwheel's cache (where it looks before downloading)."""
    from ci.release.cibw_job import cibuildwheel_modules

    cibuildwheel_modules()
    from cibuildwheel.util import resources

    with resources.VIRTUALENV.open("rb") as f:
        version = str(tomllib.load(f)["default"]["version"])
    cache = cibuildwheel_cache()
    pyz = cache / f"virtualenv-{version}.pyz"
    if pyz.exists():
        return pyz
    cache.mkdir(parents=True, exist_ok=True)
    stage = cache / f"virtualenv-{version}.stage"
    shutil.rmtree(stage, ignore_errors=True)
    log(f"[cibuildwheel] virtualenv {version} from PyPI -> {pyz}")
    from ci.runtime.pip_env import pip_environ

    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(stage),
                    f"virtualenv=={version}"], check=True, env=pip_environ())
    part = pyz.with_suffix(".part")
    subprocess.run([sys.executable, "-m", "zipapp", str(stage), "-m", "virtualenv.__main__:run_with_catch",
                    "-o", str(part)], check=True)
    part.replace(pyz)
    shutil.rmtree(stage, ignore_errors=True)
    return pyz


def environment_pass(target, environ: dict[str, str]) -> list[str]:
    """The toml's environment-pass for the target's build, as cibuildwheel's reader gives it."""
    from ci.release import cibw_job
    from ci.release.cibw_job import cibuildwheel_modules

    options, _, _ = cibuildwheel_modules()
    args = options.CommandLineArguments.defaults()
    args.platform, args.config_file, args.package_dir = "linux", str(cibw_job.CONFIG_FILE), cibw_job.PACKAGE_DIR
    opts = options.Options("linux", args, env={k: v for k, v in environ.items() if k != "CIBW_ENVIRONMENT_PASS_LINUX"})
    with opts.reader.identifier(cibw_job.identifier(target)):
        return opts.reader.get("environment-pass", option_format=options.ListFormat(sep=" ")).split()


def cannot_run(target) -> str:
    """Why the pinned cibuildwheel cannot run ``target``'s job here ("" when it can): a Linux job of
    this machine's arch, buildable here (ci.stages.resolve.local_blockers: its CUDA from PyPI, its
    torch), whose build Python the stand-in image holds, on a machine that can run the image."""
    from ci.release.standin_image import PYTHONS, cannot_run_here
    from ci.stages.resolve import local_blockers

    if target.os.platform != "linux" or target.os.machine != os.uname().machine:
        return (f"{target.id} is a {target.os.key} job: cibuildwheel runs Linux containers of this machine's arch "
                f"(linux-{os.uname().machine}) here")
    blockers = local_blockers(target, pytorch_index="http://127.0.0.1/whl")  # the stand-in's
    if blockers:
        return "; ".join(blockers)
    if target.python not in PYTHONS:
        return (f"the stand-in manylinux image holds Pythons {', '.join(PYTHONS)} (ci.release.standin_image.PYTHONS); "
                f"this job builds with {target.python}")
    return cannot_run_here()


def stock_standin(target_id: str, verify_pythons: list[str] | None = None, log=default_log) -> str:
    """PyPI's torch wheels the job installs, into the stand-in for PyTorch's index: the build
    torch for the target's floor Python (and each other Python verify runs in), and the ABI
    guard's for the first of them; returns the guard's directory."""
    from ci.release import cibw_job
    from ci.release.standin import fetch_torch, standin_dir
    from ci.toolchain.targets import Matrix

    matrix = Matrix.load()
    target = matrix.target(target_id)
    job = cibw_job.plan_job(target, matrix)
    pythons = verify_pythons or [target.python]
    for python in dict.fromkeys([target.python, *pythons]):
        fetch_torch(target.build_torch, python, matrix, log=log)
    fetch_torch(job.foreign.version, pythons[0], matrix, log=log)
    return standin_dir(job.foreign.version, matrix)


def job_environment(target_id: str, *, image: str, pytorch_index: str, cache_host: Path, log_dir: Path,
                    foreign_dir: str = "cpu", payload_dir: Path | None = None,
                    jobs: int | None = None, verify_pythons: list[str] | None = None) -> dict[str, str]:
    """The environment cibuildwheel runs with: this machine's, the job's exports (``python -m
    ci.release.cibw env``) as build-target.yml writes them, and the replacements in the module's doc.
    ``payload_dir``: a payload project inside the repository whose ``cibw_stages.py`` the hooks
    run instead of the factory's stages (``$SAGEATTN3_CIBW_PAYLOAD``, relative to the repository)."""
    from ci.release import cibw, cibw_job
    from ci.release.workflow_lint import workflow_tools_dir
    from ci.toolchain.targets import Matrix

    target = Matrix.load().target(target_id)
    if target.os.platform != "linux":
        raise LocalCibwError(f"{target_id} is a {target.os.platform} target: only Linux targets run here "
                             "(cibuildwheel's Linux containers)")
    if target.os.machine != os.uname().machine:
        raise LocalCibwError(f"{target_id} is {target.os.machine}, this machine is {os.uname().machine}")
    env = cibw_job.job_process_environ(target, child_environ(), jobs=jobs)
    passed = environment_pass(target, env)
    env.update({
        "SAGEATTN3_PYTORCH_INDEX": pytorch_index,
        "SAGEATTN3_CACHE_HOST": str(cache_host),
        "SAGEATTN3_LOG_DIR_HOST": str(log_dir),
        f"CIBW_MANYLINUX_{target.os.machine.upper()}_IMAGE": image,
        "CIBW_CONTAINER_ENGINE": CONTAINER_ENGINE,
        "CIBW_DEPENDENCY_VERSIONS": "latest",
        "PYTHONPATH": str(workflow_tools_dir()),
        "CIBW_ENVIRONMENT_PASS_LINUX": " ".join([*passed, "SAGEATTN3_FOREIGN_TORCH_DIR", cibw.PAYLOAD_ENV]),
        "SAGEATTN3_FOREIGN_TORCH_DIR": foreign_dir,
        "SAGEATTN3_CI_CLEANUP": "0",
    })
    if verify_pythons:
        env["SAGEATTN3_VERIFY_PYTHONS"] = " ".join(verify_pythons)
    else:
        env.pop("SAGEATTN3_VERIFY_PYTHONS", None)
    env.pop(cibw.PAYLOAD_ENV, None)
    if payload_dir is not None:
        env[cibw.PAYLOAD_ENV] = payload_relative(payload_dir)
    return env


def payload_relative(payload_dir: Path) -> str:
    """``payload_dir`` as ``$SAGEATTN3_CIBW_PAYLOAD`` names it: relative to the repository, which
    cibuildwheel copies into its container; it must hold a ``cibw_stages.py``."""
    from ci.release import cibw

    path = Path(payload_dir).resolve()
    if not path.is_relative_to(REPO):
        raise LocalCibwError(f"{payload_dir}: a payload project must lie inside the repository ({REPO}), "
                             "the folder cibuildwheel copies into its container")
    if not (path / cibw.STAGES_FILE).is_file():
        raise LocalCibwError(f"{payload_dir}: no {cibw.STAGES_FILE} (the stages the hooks run for it)")
    return path.relative_to(REPO).as_posix()


def run_cibuildwheel(target_id: str, output_dir: Path, *, payload_dir: Path | None = None,
                     pytorch_index: str | None = None, jobs: int | None = None, cache: Path | None = None,
                     verify_pythons: list[str] | None = None, log=default_log) -> LocalRun:
    """Real cibuildwheel for ``target_id`` in the stand-in image; its output into
    ``output_dir/cibuildwheel.log``, its wheel into ``output_dir/wheelhouse``. ``cache``: the
    runner's cache folder the container reaches through /host (SAGEATTN3_CACHE_HOST; default the
    factory's cache); ``pytorch_index``: a running stand-in for PyTorch's index (default: one
    of its own); ``verify_pythons``: verify in these Pythons (default: the target's floor).
    Raises when it fails (with the log's last lines)."""
    from ci.release.standin import pytorch_index_standin
    from ci.release.standin_image import build_image
    from ci.toolchain.tools import cache_root

    if payload_dir is not None:
        payload_relative(payload_dir)  # before minutes of image and stand-in work
    image = build_image(log=log)
    seed_virtualenv_pyz(log=log)
    output_dir.mkdir(parents=True, exist_ok=True)
    wheelhouse = output_dir / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    logs = output_dir / "build-logs"
    logs.mkdir(exist_ok=True)
    cache = Path(cache).resolve() if cache else cache_root()
    (cache / "sccache").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "cibuildwheel", "--config-file", "ci/cibuildwheel.toml", "--output-dir",
           str(wheelhouse), "ci/release/cibw_project"]
    foreign_dir = stock_standin(target_id, verify_pythons, log=log) if payload_dir is None else "cpu"
    with pytorch_index_standin() if pytorch_index is None else contextlib.nullcontext(pytorch_index) as index:
        env = job_environment(target_id, image=image, pytorch_index=index, cache_host=cache, log_dir=logs,
                              foreign_dir=foreign_dir, payload_dir=payload_dir, jobs=jobs,
                              verify_pythons=verify_pythons)
        run = LocalRun(target_id, cmd, env, output_dir, output_dir / "cibuildwheel.log")
        log(f"[cibuildwheel] {target_id}: {' '.join(cmd[1:])} (image {image}; log {run.log})")
        t0 = time.monotonic()
        with open(run.log, "w", encoding="utf-8") as out:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        run.seconds = time.monotonic() - t0
        run.returncode = proc.returncode
    run.wheels = tuple(sorted(wheelhouse.glob("*.whl")))
    if proc.returncode != 0:
        tail = "\n".join(run.log.read_text(errors="replace").splitlines()[-40:])
        raise LocalCibwError(f"cibuildwheel exited {proc.returncode} after {run.seconds:.0f}s ({run.log}):\n{tail}")
    log(f"[cibuildwheel] {target_id}: {', '.join(w.name for w in run.wheels)} in {run.seconds:.0f}s")
    return run
