"""``python -m ci.checks.bench``: the command line of :mod:`ci.checks.bench`."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from ci.checks.bench import __doc__ as DOC, _use_compiler_cache, timed_build
from ci.runtime.errors import run_main
from ci.stages import build as buildmod
from ci.stages.resolve import default_target
from ci.stages.resolve import resolve_toolchain
from ci.toolchain.targets import Matrix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.checks.bench", description=DOC.split("\n\n")[0])
    ap.add_argument("target", nargs="?", metavar="ID", help="the target to build (default: the host's default target)")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a.target))  # an unknown target: "error: ...", exit status 2


def _cli(target_id: str | None) -> int:
    matrix = Matrix.load()
    target = matrix.target(target_id) if target_id else default_target(matrix)
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
