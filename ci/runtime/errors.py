"""The factory's one error base and the runner that ends every command line.

A :class:`FactoryError` is a failure (exit status 1): something ran and did not work. An
:class:`InputError` is bad input (exit status 2): an argument, a matrix entry or a missing tool,
found before anything ran. Each error class of ci/ derives from one of the two, keeping its
name, its message and its older base (``ValueError``, ``RuntimeError``), so code that catches
those still does. A command's ``main`` ends through :func:`run_main`, which prints the message
on one line and returns the class's exit status.
"""

from __future__ import annotations

import sys
from typing import Callable


class FactoryError(Exception):
    """Something ran and did not work: exit status 1."""

    exit_code = 1


class InputError(FactoryError):
    """Bad input, found before anything ran: exit status 2."""

    exit_code = 2


def run_main(fn: Callable[[], int], *, prefix: str | None = "error") -> int:
    """``fn()``'s exit status; a :class:`FactoryError` it raises becomes ``PREFIX: message`` on
    stderr (``prefix`` None: the message alone, for a command whose messages each name
    themselves) and the error's exit status. Other exceptions propagate (a bug shows its
    traceback)."""
    try:
        return fn()
    except FactoryError as e:
        print(e if prefix is None else f"{prefix}: {e}", file=sys.stderr)
        return e.exit_code
