"""bench-build: cold build time of the host target (empty compiler cache), peak memory of the
build's process tree, warm rebuild time with no source change, their ratio, wheel size.
Figures are printed, not asserted: run it on the machine you care about."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import psutil

from ci.stages import build as buildmod
from ci.stages.resolve import resolve_toolchain
from ci.toolchain.tools import compiler_launcher, sccache_env
from ci.runtime.env import FactoryEnv, child_environ, set_environ


class PeakRSS:
    """Peak of the machine's used memory above its level at the start. The compilers run
    under sccache's server (not our children), so the whole machine is what we can see:
    run the benchmark on an otherwise idle machine."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _run(self):
        base = psutil.virtual_memory().used
        while not self._stop.is_set():
            self.peak = max(self.peak, psutil.virtual_memory().used - base)
            time.sleep(self.interval)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _use_compiler_cache(cache_dir: Path | None) -> None:
    """Point builds at ``cache_dir`` (a server of its own: see sccache_env), stopping the
    server of the previous one."""
    launcher = compiler_launcher()
    if launcher and FactoryEnv.from_environ().sccache_dir:
        subprocess.run([*launcher, "--stop-server"], capture_output=True, env=child_environ(sccache_env()))
    set_environ("SCCACHE_DIR", None if cache_dir is None else str(cache_dir))


def timed_build(target, matrix, out: Path) -> tuple[float, int, Path]:
    t0 = time.monotonic()
    with PeakRSS() as mem:
        result = buildmod.build(resolve_toolchain(target, matrix), matrix, out, log=lambda *_: None)
    return time.monotonic() - t0, mem.peak, result.wheel
