"""PEP 517 backend of the cibuildwheel shim: ``build_wheel`` hands over to the factory.

It runs under cibuildwheel's build Python (the target's oldest, e.g. 3.9), while the factory
needs Python >= 3.11: it calls ``$SAGEATTN3_FACTORY_PYTHON ci/release/cibw/__main__.py build`` (falling back to
the running interpreter), which compiles with the target's own torch environment. The torch
environment is made for *this* Python (``SAGEATTN3_BUILD_PYTHON``), the one verify installs the
wheel into next, so verify reuses it instead of installing torch a second time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CIBW = Path(__file__).resolve().parents[1] / "cibw" / "__main__.py"


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    python = os.environ.get("SAGEATTN3_FACTORY_PYTHON") or sys.executable
    here = "%d.%d" % sys.version_info[:2]
    # The frontend's hook variables (backend name and backend-path) must not reach the pip that
    # builds the payload inside the factory: its own hook runner would take them for its own
    # and refuse the payload's backend ("Backend was not loaded from backend-path").
    env = {k: v for k, v in os.environ.items() if not k.startswith(("_PYPROJECT_HOOKS_", "PEP517_"))}
    env["SAGEATTN3_BUILD_PYTHON"] = here
    # cibuildwheel builds in a venv; the factory makes its own venvs from the base interpreter.
    env.setdefault("SAGEATTN3_PYTHON_" + here.replace(".", "_"), getattr(sys, "_base_executable", sys.executable))
    # pip runs this hook with its stdout on a pipe, which a Python child block-buffers: the build's
    # progress lines would reach cibuildwheel's log in one burst at the end. Unbuffered (-u, and
    # PYTHONUNBUFFERED for the factory's own children), each line goes through as it is printed.
    env["PYTHONUNBUFFERED"] = "1"
    before = set(os.listdir(wheel_directory))
    subprocess.run([python, "-u", str(CIBW), "build", "--out", str(wheel_directory)], check=True, env=env)
    new = sorted(n for n in os.listdir(wheel_directory) if n.endswith(".whl") and n not in before)
    if len(new) != 1:
        raise RuntimeError(f"the factory's build stage left {new} in {wheel_directory}, expected one wheel")
    return new[0]
