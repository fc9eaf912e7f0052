"""An isolated build environment: a cached venv holding the target's torch and the packages a
build needs beside it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

from ci.toolchain.resolved import TorchEnv, venv_python
from ci.toolchain.tools.base import ToolchainError, _output, cache_root, run_pip
from ci.toolchain.tools.pythons import find_python

# What a build environment holds besides torch. setuptools >= 77: the payload's SPDX `license`
# and `license-files` (its pyproject's build-system.requires says the same).
BUILD_ENV_PACKAGES = ("setuptools>=77", "wheel", "packaging")


def torch_env(python_version: str, torch_spec: str, extra: tuple[str, ...] = BUILD_ENV_PACKAGES,
              index_args: tuple[str, ...] = ()) -> TorchEnv:
    """A cached venv with ``torch_spec`` (e.g. "torch==2.14.1") for that Python. With
    ``index_args`` (e.g. PyTorch's ``--index-url``) torch comes from there and ``extra`` from
    pip's default index, in a second install."""
    # A loopback stand-in index (the release rehearsal) gets a new port each run; what it
    # serves does not change, so the port is not part of the key.
    where = [re.sub(r"^(https?://127\.0\.0\.1):\d+", r"\1", a) for a in index_args]
    # The key is the torch (Python, requirement, index): the build packages beside it are
    # brought to ``extra`` in place (ensure_packages), so raising their floor re-creates nothing.
    what = [python_version, torch_spec] + ([where] if where else [])
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:10]
    root = cache_root() / "envs" / f"py{python_version}-{torch_spec.replace('==', '-').replace('+', '_')}-{key}"
    marker = root / ".complete"
    if not is_complete(root):
        if root.exists():
            shutil.rmtree(root)
        py = find_python(python_version)
        run_pip([str(py), "-m", "venv", str(root)])
        try:
            if index_args:
                run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", torch_spec, *index_args])
                if extra:
                    run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", *extra])
            else:
                run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", torch_spec, *extra])
        except subprocess.CalledProcessError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise ToolchainError(
                f"could not install {torch_spec} for Python {python_version} (pip exited {e.returncode}); "
                f"is that torch published for Python {python_version}?"
            ) from e
        info = _output([str(venv_python(root)), "-c", "import torch, json; print(json.dumps([torch.__version__, torch.version.cuda]))"])
        (root / EXTRA_MARKER).write_text(json.dumps(list(extra)))
        marker.write_text(info)
    else:
        ensure_packages(root, extra)
    version, cuda = json.loads(marker.read_text())
    return TorchEnv(root, python_version, version, cuda)


def is_complete(root: Path) -> bool:
    """A cached environment is usable: it was filled to the end (``.complete``) and its
    interpreter is still there (an environment made in a container, or by a Python since moved,
    links to an interpreter this machine lacks: it is made again)."""
    return (root / ".complete").exists() and venv_python(root).exists()


# Beside an environment's .complete: the requirements its build packages were last installed for.
EXTRA_MARKER = ".extra.json"


def ensure_packages(root: Path, extra: tuple[str, ...]) -> None:
    """A cached environment holds ``extra`` as asked now (e.g. after a floor was raised): when
    it was last made or checked for other requirements, ``pip install`` them in place (a no-op
    for those already satisfied) and remember it."""
    if not extra:
        return
    stamp = root / EXTRA_MARKER
    try:
        if json.loads(stamp.read_text()) == list(extra):
            return
    except (OSError, ValueError):
        pass
    try:
        run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", *extra])
    except subprocess.CalledProcessError as e:
        raise ToolchainError(f"could not install {' '.join(extra)} into the cached environment {root} "
                             f"(pip exited {e.returncode}); remove it to start it afresh") from e
    stamp.write_text(json.dumps(list(extra)))
