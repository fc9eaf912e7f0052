"""The probe's stages: what cibuildwheel's hooks (ci/release/cibw/__main__.py) run on this
one-file C extension instead of the factory's stages on sageattn3/. ``$SAGEATTN3_CIBW_PAYLOAD=
tests/cibw_probe`` points the hooks here (ci.release.cibw.stages() loads this file by its path);
ci.release.cibw_local sets it and cibuildwheel passes it into its container
(``nox -s cibuildwheel -- --payload-dir tests/cibw_probe``, tests/test_cibw_local.py).

The same hook commands, container, environment and hook plumbing as a release job, in minutes:
no CUDA toolkit, a ``pip wheel`` of this project with the build Python, the factory's repair
(auditwheel with its excludes) without the tag stage (there is no build record to tag by), and
a verify that installs the wheel with its dependency into a fresh venv of the test Python."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from ci.release.cibw import Stages, dist_dir, use_python
from ci.release.runner_setup import CibwError, cuda_commands
from ci.runtime.env import FactoryEnv, child_environ
from ci.runtime.log import default_log
from ci.runtime.pip_env import pip_environ
from ci.toolchain.targets import Matrix, Target

PROJECT = Path(__file__).resolve().parent


def install_cuda(target: Target, github_env: Path | None = None, log=default_log) -> None:
    """before-all: nothing (the extension needs no toolkit); says what the payload's job runs."""
    cmds = cuda_commands(target)
    log(f"[cuda] probe payload: no toolkit installed (the payload's job runs {cmds or 'the PyPI provisioning'})")


def build(matrix: Matrix, target: Target, wheel_dir: Path, log=default_log) -> Path:
    """``pip wheel`` with the Python cibuildwheel builds with (the shim's), abi3 for the target's floor."""
    from ci.toolchain.tools import find_python

    here = FactoryEnv.from_environ().build_python or target.python
    python = find_python(here)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    before = set(wheel_dir.glob("*.whl"))
    cmd = [str(python), "-m", "pip", "wheel", "--no-deps", "-w", str(wheel_dir), str(PROJECT)]
    log(f"[build] probe payload, Python {here}: {' '.join(cmd)}")
    subprocess.run(cmd, check=True, env=pip_environ(extra={"SAGEATTN3_PROBE_LIMITED_API": target.python_tag}))
    new = sorted(set(wheel_dir.glob("*.whl")) - before)
    if len(new) != 1 or f"-{target.python_tag}-abi3-" not in new[0].name:
        raise CibwError(f"the probe's build left {[w.name for w in new]}, expected one {target.python_tag}-abi3 wheel")
    return new[0]


def repair(target: Target, wheel: Path, dest_dir: Path, log=default_log) -> Path:
    """The factory's repair (auditwheel/delvewheel with its excludes), then a copy into
    ``dest_dir``: no tag stage, there is no build record to tag by."""
    from ci.stages.repair import repair as repair_wheel

    repaired = repair_wheel(wheel, dist_dir() / "repaired" / target.id, target.os.platform,
                            settings=FactoryEnv.from_environ(), log=log)
    dest_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(repaired, dest_dir / repaired.name)
    log(f"[repair] probe payload: {repaired.name}")
    return dest_dir / repaired.name


def verify(matrix: Matrix, target: Target, wheel: Path, pythons: list[str], python_exe: str | None,
           log=default_log) -> str:
    """The test Python must be the target's floor, as for the payload; a fresh venv of it gets
    the wheel with its dependency, and the extension runs."""
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


STAGES = Stages(install_cuda=install_cuda, build=build, repair=repair, verify=verify)
