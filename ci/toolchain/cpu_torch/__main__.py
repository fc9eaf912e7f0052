"""``python -m ci.toolchain.cpu_torch``: the command line of :mod:`ci.toolchain.cpu_torch`."""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from ci.toolchain.cpu_torch import CPU_TORCH, PYTORCH_CPU_INDEX, cpu_build_problem, describe, install


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install"]:
        import argparse

        p = argparse.ArgumentParser(prog="python -m ci.toolchain.cpu_torch install")
        p.add_argument("--spec", default=CPU_TORCH, help=f"the CPU build to install (default {CPU_TORCH})")
        p.add_argument("--cpu-index", default=PYTORCH_CPU_INDEX, help="PyTorch's CPU index, asked second")
        a = p.parse_args(argv[1:])
        return install(a.spec, (None, a.cpu_index))
    if argv != ["check"]:
        print("usage: python -m ci.toolchain.cpu_torch check|install [--spec S] [--cpu-index URL]", file=sys.stderr)
        return 2
    try:
        dist = md.distribution("torch")
    except md.PackageNotFoundError:
        print(f"no torch installed in {sys.prefix}: install {CPU_TORCH}", file=sys.stderr)
        return 1
    problem = cpu_build_problem(dist)
    if problem:
        print(f"not a CPU build of torch ({Path(str(dist.locate_file(''))).resolve()}): {problem}; "
              f"install {CPU_TORCH} (--extra-index-url {PYTORCH_CPU_INDEX})", file=sys.stderr)
        return 1
    print(f"CPU build: {describe(dist)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
