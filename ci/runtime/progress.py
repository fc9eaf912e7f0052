"""How a long stage shows that it is at work, and where its lines are kept.

On a terminal, a live status line drawn by ``rich`` (spinner, stage, elapsed seconds, the
stage's latest line) sits under the lines the stage prints. Elsewhere (CI logs, pipes, a logger
that does not write to this process's stdout, or ``rich`` missing) a quiet spell of ``every``
seconds gets a plain line "[stage] still working (N s)", so a long torch install or toolchain
download never looks like a hang in a log either. The factory's logger
(:class:`ci.runtime.log.Log`) hands out both wrappers: ``log.step(name)`` and ``log.tee(path)``.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from ci.runtime.env import FactoryEnv
from pathlib import Path

# A stage that has said nothing for this long says that it is still at work (and for how long).
HEARTBEAT_S = 30.0


def live_terminal(log) -> bool:
    """Whether ``log`` writes to an interactive terminal that a live line may redraw: a logger
    that says it writes to this process's stdout (``log.terminal``; a tee says what it wraps
    does), that stdout a terminal, outside CI."""
    if getattr(log, "terminal", False) is not True or (env := FactoryEnv.from_environ()).ci or env.term == "dumb":
        return False
    return importlib.util.find_spec("rich") is not None and sys.stdout.isatty()


class StageProgress:
    """Wraps a log function for the span of one stage (a context manager): every line goes
    through to ``log``; meanwhile a live line (terminal) or heartbeat lines (elsewhere) say how
    long the stage has run."""

    def __init__(self, log, stage: str, every: float = HEARTBEAT_S, *, live: bool | None = None) -> None:
        self._log, self.stage, self.every = log, stage, every
        self._last = self._t0 = time.monotonic()
        self._latest = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self.live = live_terminal(log) if live is None else live
        self._status = None

    def __call__(self, msg: str) -> None:
        self._last = time.monotonic()
        self._latest = msg.strip().splitlines()[-1] if msg.strip() else self._latest
        self._log(msg)

    def _text(self) -> str:
        latest = self._latest if len(self._latest) <= 90 else self._latest[:87] + "..."
        return f"[{self.stage}] {time.monotonic() - self._t0:.0f} s  {latest}"

    def _renderable(self):
        from rich.text import Text  # plain text: "[build]" is not markup

        return Text(self._text())

    def _beat(self) -> None:
        while not self._stop.wait(1.0 if self.live else min(self.every, 5.0)):
            now = time.monotonic()
            if self._status is not None:
                self._status.update(self._renderable())
            elif now - self._last >= self.every:
                self._last = now
                self._log(f"[{self.stage}] still working ({now - self._t0:.0f} s)")

    def __enter__(self):
        if self.live:
            from rich.console import Console

            # The status redirects print() above its line while it is shown.
            self._status = Console(highlight=False).status(self._renderable(), spinner="dots")
            self._status.start()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._status is not None:
            self._status.stop()


class TeeLog:
    """A log function that also appends each line, with the time since it was made, to a file:
    the factory's own full record of one target (``dist/logs/<target>.log``)."""

    def __init__(self, log, path: Path) -> None:
        self._log = self.wraps = log
        self.path = path
        self._t0 = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    @property
    def terminal(self) -> bool:
        """A tee writes a file beside what it wraps: it reaches the terminal when that does."""
        return getattr(self.wraps, "terminal", False) is True

    def __call__(self, msg: str) -> None:
        with self.path.open("a", encoding="utf-8", errors="replace") as f:
            for line in str(msg).splitlines() or [""]:
                f.write(f"{time.monotonic() - self._t0:8.1f}s {line}\n")
        self._log(msg)
