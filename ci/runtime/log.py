"""The factory's one logger: where the lines of a command go.

A :class:`Log` is called with one message (a line, or several) and writes it to its backend:
by default this process's stdout, exactly as ``print`` does (the stream is looked up at each
call, so a live progress line or a test's capture sees it). :data:`default_log` is that
instance, the default of every ``log`` parameter in ``ci/``; a ``log`` may still be any
callable that takes one message (a list's ``append`` in a test, a lambda that writes to
stderr).

Two ways to wrap a logger, both from :mod:`ci.runtime.progress`:

- :meth:`Log.step` gives a stage its progress (:class:`~ci.runtime.progress.StageProgress`): a
  live status line under the stage's lines on a terminal, heartbeat lines elsewhere;
- :meth:`Log.tee` also keeps every line in a file (:class:`~ci.runtime.progress.TeeLog`).

Whether a live line may be drawn is the logger's to say (:attr:`Log.terminal`), not a
comparison with ``print``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ci.runtime.progress import HEARTBEAT_S, StageProgress, TeeLog


class Log:
    """A callable that writes one message per call to ``backend`` (None: stdout, as ``print``)."""

    def __init__(self, backend: Callable[[str], None] | None = None) -> None:
        self.backend = backend

    def __call__(self, msg: str) -> None:
        if self.backend is None:
            print(msg)
        else:
            self.backend(msg)

    @property
    def terminal(self) -> bool:
        """Whether the lines reach this process's stdout as they are written (straight, or
        through a backend that says so, e.g. a tee of such a logger): where a live progress line
        may be drawn when stdout is a terminal."""
        return self.backend is None or getattr(self.backend, "terminal", False) is True

    def step(self, name: str, every: float = HEARTBEAT_S, *, live: bool | None = None) -> StageProgress:
        """The progress of the stage ``name`` (a context manager that is the stage's logger):
        each line goes through to this logger; a live line or heartbeat lines say how long the
        stage has run (``live``: force the live line on or off)."""
        return StageProgress(self, name, every, live=live)

    def tee(self, path: Path) -> "Log":
        """This logger, each line also appended to ``path`` (emptied now) with the time since."""
        return Log(TeeLog(self, path))

    @classmethod
    def of(cls, log: Callable[[str], None]) -> "Log":
        """``log`` as a :class:`Log` (itself when it is one)."""
        return log if isinstance(log, Log) else cls(log)


# The default logger of every command of the factory: stdout, line by line, as print writes.
default_log = Log()
