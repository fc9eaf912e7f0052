"""The payload as the factory sees it: where it lies, and the two files of it the factory runs,
``sageattn3/build_profile.py`` (the flags, as data) and ``sageattn3/build_commands.py`` (the
compile and link commands its ``setup.py`` runs). Neither is an installed module: each is loaded
from its file, here and nowhere else."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

PAYLOAD = Path(__file__).resolve().parents[2] / "sageattn3"


def load(path: Path, name: str) -> ModuleType:
    """The module in ``path``, executed now under ``name`` (registered in ``sys.modules`` so its
    dataclasses resolve their module)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@cache
def build_profile() -> ModuleType:
    """``sageattn3/build_profile.py``: the flag profile of a build, as data."""
    return load(PAYLOAD / "build_profile.py", "sageattn3_build_profile")


@cache
def build_commands() -> ModuleType:
    """``sageattn3/build_commands.py``: the payload's own command builder (what its setup.py imports)."""
    return load(PAYLOAD / "build_commands.py", "sageattn3_build_commands")
