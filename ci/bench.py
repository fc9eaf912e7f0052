"""bench-build: cold build time of the host target (empty compiler cache), peak memory of the
build's process tree, warm rebuild time with no source change, their ratio, wheel size.
Figures are printed, not asserted: run it on the machine you care about."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from ci import build as buildmod
from ci.resolve import resolve_toolchain
from ci.resolve import default_target
from ci.targets import Matrix
from ci.toolchain import compiler_launcher, sccache_env


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
    if launcher and os.environ.get("SCCACHE_DIR"):
        subprocess.run([*launcher, "--stop-server"], capture_output=True, env={**os.environ, **sccache_env()})
    if cache_dir is None:
        os.environ.pop("SCCACHE_DIR", None)
    else:
        os.environ["SCCACHE_DIR"] = str(cache_dir)


def timed_build(target, matrix, out: Path) -> tuple[float, int, Path]:
    t0 = time.monotonic()
    with PeakRSS() as mem:
        result = buildmod.build(resolve_toolchain(target, matrix), matrix, out, log=lambda *_: None)
    return time.monotonic() - t0, mem.peak, result.wheel


def main(argv: list[str] | None = None) -> int:
    matrix = Matrix.load()
    target = matrix.target(argv[0]) if argv else default_target(matrix)
    with tempfile.TemporaryDirectory(prefix="sageattn3-bench-") as tmp:
        try:
            _use_compiler_cache(Path(tmp) / "sccache-prime")
            # Warm the torch/CUDA/CUTLASS provisioning first so only compiling is measured.
            buildmod.build(resolve_toolchain(target, matrix), matrix, Path(tmp) / "prime", log=lambda *_: None)
            _use_compiler_cache(Path(tmp) / "sccache-cold")  # cold: an empty compiler cache
            cold, cold_mem, wheel = timed_build(target, matrix, Path(tmp) / "cold")
            # no change: the build stage sees the same inputs and does nothing new
            warm, warm_mem, _ = timed_build(target, matrix, Path(tmp) / "cold")
            # a Python-only change elsewhere (new output dir): every object from the compiler cache
            recompile, _, _ = timed_build(target, matrix, Path(tmp) / "recompile")
        finally:
            _use_compiler_cache(None)
        size = wheel.stat().st_size
        print(f"target            {target.id} (archs {' '.join(target.archs)})")
        print(f"cold build        {cold:7.1f} s   (empty compiler cache)")
        print(f"peak memory       {cold_mem / 2**30:7.2f} GiB (cold build, all compiler processes)")
        print(f"warm rebuild      {warm:7.1f} s   (no source change; peak {warm_mem / 2**30:.2f} GiB)")
        print(f"warm / cold       {warm / cold:7.1%}")
        print(f"cached recompile  {recompile:7.1f} s   (fresh output dir: all objects from sccache; {recompile / cold:.1%} of cold)")
        print(f"wheel size        {size / 1e6:7.3f} MB ({wheel.name})")
        print(f"cpus              {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
