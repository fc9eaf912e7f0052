"""Tests that need CPythons beside the one running them (the stand-in image's /opt/python/*, a
second verify Python): on a machine with one Python, where the factory cannot provision the
others either, they skip and say which Python and why, instead of failing."""

from __future__ import annotations

import re
from contextlib import contextmanager

import pytest

from ci.toolchain.tools import ToolchainError


@contextmanager
def skip_without_python(what: str):
    """Run the block; a ``ToolchainError`` "Python X.Y not found" raised in it skips the test."""
    try:
        yield
    except ToolchainError as e:
        m = re.match(r"Python (\d+\.\d+) not found", str(e))
        if not m:
            raise
        pytest.skip(f"needs Python {m.group(1)} for {what}: {str(e)[:300]}")
