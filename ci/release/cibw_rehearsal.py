"""A release build job's cibuildwheel hooks, resolved by the pinned cibuildwheel and run here.

The rehearsal (``nox -s release -- --dry-run``) must run what cibuildwheel runs. It does not
read ``ci/cibuildwheel.toml`` itself: the pinned cibuildwheel (ci/requirements-workflows.txt)
resolves its options, with ``--config-file`` semantics, for the job's environment (``python -m
ci.release.cibw env --target ID`` plus the runner's variables), exactly as a job's ``cibuildwheel`` call
does. From cibuildwheel's resolved ``BuildOptions`` come:

    before-all, repair-wheel-command, test-command   the commands, placeholders filled by
                                                     cibuildwheel's own ``prepare_command``
    environment (+ environment-pass)                 applied to the build hooks' environment
    test-environment                                 applied on top for the test hook
    build-frontend, build-verbosity                  the build's pip flags

The steps run in cibuildwheel's Linux order, each as ``sh -c`` (as cibuildwheel runs them in its
container), with the base variables cibuildwheel sets for each. What differs from a job, and
only this:

1. No container. Container paths in the resolved environment are mapped to this machine's:
   ``/host/X`` (cibuildwheel's mount of the runner's root) is ``/X``, and
   ``/opt/python/cpXY-cpXY`` (the image's interpreters) is a virtual environment of this
   machine's CPython X.Y in the factory cache (so before-all's installs stay out of it).
2. The container's own environment (its image's) is stood in for by a few of this machine's
   variables (``HOST_BASE``) with pip configured by nothing but what the hooks pass.
3. ``REHEARSAL_ONLY``: the stand-in for PyTorch's index has no CPU builds, so the ABI guard's
   torch comes from the directory it does serve, and the factory's dist/ is the rehearsal's.
4. The test hook's virtual environment is made with ``venv`` (cibuildwheel uses virtualenv).

Real cibuildwheel in a container is ``nox -s cibuildwheel`` (ci/release/cibw_local/).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ci.release.cibw_job import RehearsalError, ResolvedJob, job_process_environ, resolve
from ci.runtime.log import default_log
from ci.toolchain.targets import Matrix, Target
from ci.runtime.env import child_environ

REPO = Path(__file__).resolve().parents[2]
HOST_BASE = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SSL_CERT_FILE", "SSL_CERT_DIR", "PIP_CERT",
             "PIP_DEFAULT_TIMEOUT")
# cibuildwheel's mount of the runner's root inside its container (oci_container: --volume=/:/host)
HOST_MOUNT = "/host"
CONTAINER_PYTHONS = "/opt/python"


# -- this machine in place of the container --------------------------------------------------

@dataclass
class HostLayout:
    """Container paths -> this machine's (see the module's docstring, point 1)."""

    pythons: dict[str, Path] = field(default_factory=dict)  # "cp312-cp312" -> a venv here
    venv_root: Path = Path()

    def python(self, tag: str) -> Path:
        """The venv standing in for ``/opt/python/<tag>`` (made once, from this machine's CPython)."""
        from ci.toolchain.tools import find_python

        if tag not in self.pythons:
            version = f"{tag[2]}.{tag.split('-')[0][3:]}"
            venv = self.venv_root / tag
            if not (venv / "bin" / "python").exists():
                from ci.runtime.pip_env import pip_environ

                subprocess.run([str(find_python(version)), "-m", "venv", str(venv)], check=True, env=pip_environ())
            self.pythons[tag] = venv
        return self.pythons[tag]

    def to_host(self, value: str) -> str:
        """A value of the resolved environment with its container paths made this machine's."""
        prefix = CONTAINER_PYTHONS + "/"
        while prefix in value:
            start = value.index(prefix)
            tag = value[start + len(prefix):].split("/", 1)[0]
            value = value[:start] + str(self.python(tag)) + value[start + len(prefix) + len(tag):]
        if value.startswith(HOST_MOUNT + "/"):
            value = value[len(HOST_MOUNT):]
        return value.replace(":" + HOST_MOUNT + "/", ":/")

    def env(self, environ: dict[str, str]) -> dict[str, str]:
        return {k: self.to_host(v) for k, v in environ.items()}


def container_base() -> dict[str, str]:
    """The variables a hook starts from here (point 2): HOST_BASE, pip configured by nothing
    but what is passed (ci.runtime.pip_env, no package sources), and cibuildwheel's CIBUILDWHEEL=1."""
    from ci.runtime.pip_env import pip_environ

    host = child_environ()
    env = pip_environ({k: host[k] for k in HOST_BASE if k in host}, sources=False)
    env["CIBUILDWHEEL"] = "1"
    return env


# -- the hooks, in cibuildwheel's Linux order ---------------------------------------------------

@dataclass
class HookRun:
    name: str
    command: str
    env: dict[str, str]
    seconds: float = 0.0


def _sh(run: HookRun, logs: Path, cwd: Path, log=default_log) -> HookRun:
    """One hook as ``sh -c`` (as cibuildwheel runs it); output into ``logs/<name>.log``; a
    failure raises with the last lines."""
    logs.mkdir(parents=True, exist_ok=True)
    log(f"[{run.name}] {run.command}")
    t0 = time.monotonic()
    path = logs / f"{run.name}.log"
    with open(path, "w", encoding="utf-8") as out:
        proc = subprocess.run(["sh", "-c", run.command], env=run.env, cwd=cwd, stdout=out,
                              stderr=subprocess.STDOUT, text=True)
    run.seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join(path.read_text(errors="replace").splitlines()[-30:])
        raise RehearsalError(f"{run.name} exited {proc.returncode} after {run.seconds:.0f}s ({path}):\n{tail}")
    return run


@dataclass
class JobRehearsal:
    """The hooks of one job, each with the command and environment cibuildwheel gave it."""

    job: ResolvedJob
    layout: HostLayout
    work: Path
    base: dict[str, str] = field(default_factory=container_base)
    overlay: dict[str, str] = field(default_factory=dict)  # REHEARSAL_ONLY (point 3)
    runs: list[HookRun] = field(default_factory=list)

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def _env(self, python_bin: str, test_venv: Path | None = None) -> dict[str, str]:
        """cibuildwheel's sequence: the container's variables, its own, ``environment`` (with
        environment-pass) on top; for the test hook also the venv and ``test-environment``."""
        env = dict(self.base)
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        env["PIP_ROOT_USER_ACTION"] = "ignore"
        env["PATH"] = f"{python_bin}:{env.get('PATH', '/usr/bin:/bin')}"
        env = self.job.options.environment.as_dictionary(env)
        env = {**self.layout.env(env), **self.overlay}
        if test_venv is not None:
            env["PATH"] = f"{test_venv / 'bin'}:{env['PATH']}"
            env["VIRTUAL_ENV"] = str(test_venv)
            env = self.layout.env(self.job.options.test_environment.as_dictionary(env))
        return env

    def _python_bin(self) -> str:
        return f"{CONTAINER_PYTHONS}/{self.job.identifier.split('-', 1)[0]}-{self.job.identifier.split('-', 1)[0]}/bin"

    def _placeholders(self, **extra: str) -> dict[str, str]:
        return {"project": str(REPO), "package": str(self.job.options.package_dir), **extra}

    def before_all(self, log=default_log) -> HookRun | None:
        cmd = self.job.command("before_all", **self._placeholders())
        if not cmd:
            return None
        run = HookRun("before-all", cmd, self._env(f"{CONTAINER_PYTHONS}/cp39-cp39/bin"))
        self.runs.append(_sh(run, self.logs, REPO, log))
        return run

    def build(self, log=default_log) -> Path:
        out = self.work / "built_wheel"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        env = self._env(self._python_bin())
        env["CIBUILDWHEEL_BUILD_IDENTIFIER"] = self.job.identifier
        import shlex

        cmd = shlex.join(["python", "-m", "pip", "wheel", str(self.job.options.package_dir), f"--wheel-dir={out}",
                          "--no-deps", *self.job.build_flags()])
        self.runs.append(_sh(HookRun("build", cmd, env), self.logs, REPO, log))
        return _one_wheel(out, "the build")

    def repair(self, wheel: Path, log=default_log) -> Path:
        out = self.work / "repaired_wheel"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        cmd = self.job.command("repair_command", **self._placeholders(wheel=str(wheel), dest_dir=str(out)))
        if not cmd:
            shutil.move(str(wheel), out / wheel.name)
        else:
            env = self._env(self._python_bin())
            env["CIBUILDWHEEL_BUILD_IDENTIFIER"] = self.job.identifier
            self.runs.append(_sh(HookRun("repair", cmd, env), self.logs, REPO, log))
        return _one_wheel(out, "the repair-wheel-command")

    def test(self, wheel: Path, log=default_log) -> HookRun | None:
        """The test hook: a fresh venv of the build Python, the wheel (+ test-requires)
        installed in it with the test environment, then the test-command from a scratch cwd."""
        cmd = self.job.command("test_command", **self._placeholders(wheel=str(wheel)))
        if not cmd:
            return None
        tmp = self.work / "test"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "test_cwd").mkdir(parents=True)
        venv = tmp / "venv"
        python = self.layout.to_host(self._python_bin() + "/python")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        env = self._env(self.layout.to_host(self._python_bin()), test_venv=venv)
        installs = [["pip", "install", str(wheel) + self.job.options.test_extras]]
        if self.job.options.test_requires:
            installs.append(["pip", "install", *self.job.options.test_requires])
        for argv in installs:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp)
            if proc.returncode != 0:
                raise RehearsalError(f"test: {' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        run = HookRun("test", cmd, env)
        self.runs.append(_sh(run, self.logs, tmp / "test_cwd", log))
        return run

    def timings(self) -> dict[str, float]:
        return {r.name: r.seconds for r in self.runs}


def _one_wheel(folder: Path, step: str) -> Path:
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise RehearsalError(f"{step} left {[w.name for w in wheels]} in {folder}, expected one wheel")
    return wheels[0]


def job_environ(target: Target, *, pytorch_index: str, cache: Path, log_dir: Path,
                verify_pythons: list[str] | None = None) -> dict[str, str]:
    """What cibuildwheel reads in the rehearsed job: the runner's variables (pip configured by
    nothing but what is passed), the job's exports (``python -m ci.release.cibw env``) with the stand-in
    as PyTorch's index, and build-target.yml's cache and log folders; a developer machine keeps
    its caches (no cleanup between the steps)."""
    from ci.runtime.pip_env import pip_environ

    env = job_process_environ(target, pip_environ(sources=False))
    env.update(SAGEATTN3_PYTORCH_INDEX=pytorch_index, SAGEATTN3_CACHE_HOST=str(cache),
               SAGEATTN3_LOG_DIR_HOST=str(log_dir), SAGEATTN3_CI_CLEANUP="0")
    if verify_pythons:
        env["SAGEATTN3_VERIFY_PYTHONS"] = " ".join(verify_pythons)
    else:
        env.pop("SAGEATTN3_VERIFY_PYTHONS", None)
    return env


def rehearse_job(target_id: str, dist: Path, *, pytorch_index: str, foreign_dir: str = "cpu",
                 verify_pythons: list[str] | None = None, config_file: Path | None = None,
                 log=default_log) -> JobRehearsal:
    """One release build job's hooks, as cibuildwheel resolves them, run here: before-all,
    build, repair-wheel-command, test-command. Returns the rehearsal (its repaired wheel in
    ``work/repaired_wheel``, each hook's time in ``timings()``)."""
    from ci.toolchain.tools import cache_root

    target = Matrix.load().target(target_id)
    work = dist / "cibw" / target_id
    shutil.rmtree(work, ignore_errors=True)
    environ = job_environ(target, pytorch_index=pytorch_index, cache=cache_root(), log_dir=work / "build-logs",
                          verify_pythons=verify_pythons)
    job = resolve(target, environ, config_file=config_file)
    layout = HostLayout(venv_root=cache_root() / "rehearsal-pythons")
    overlay = {"SAGEATTN3_FOREIGN_TORCH_DIR": foreign_dir, "SAGEATTN3_DIST": str(dist)}
    r = JobRehearsal(job, layout, work, overlay=overlay)
    r.before_all(log)
    built = r.build(log)
    repaired = r.repair(built, log)
    r.test(repaired, log)
    return r
