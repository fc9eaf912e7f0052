"""``python -m ci.toolchain.cpu_torch``: the command line of :mod:`ci.toolchain.cpu_torch`."""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from ci.runtime.errors import FactoryError, InputError, run_main
from ci.toolchain.cpu_torch import CPU_TORCH, PYTORCH_CPU_INDEX, cpu_build_problem, describe, install

USAGE = "usage: python -m ci.toolchain.cpu_torch check|install [--spec S] [--cpu-index URL]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_main(lambda: _cli(argv), prefix=None)  # each message names itself (a usage line, what to install)


def _cli(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        import argparse

        p = argparse.ArgumentParser(prog="python -m ci.toolchain.cpu_torch install")
        p.add_argument("--spec", default=CPU_TORCH, help=f"the CPU build to install (default {CPU_TORCH})")
        p.add_argument("--cpu-index", default=PYTORCH_CPU_INDEX, help="PyTorch's CPU index, asked second")
        a = p.parse_args(argv[1:])
        return install(a.spec, (None, a.cpu_index))
    if argv != ["check"]:
        raise InputError(USAGE)
    try:
        dist = md.distribution("torch")
    except md.PackageNotFoundError:
        raise FactoryError(f"no torch installed in {sys.prefix}: install {CPU_TORCH}") from None
    problem = cpu_build_problem(dist)
    if problem:
        raise FactoryError(f"not a CPU build of torch ({Path(str(dist.locate_file(''))).resolve()}): {problem}; "
                           f"install {CPU_TORCH} (--extra-index-url {PYTORCH_CPU_INDEX})")
    print(f"CPU build: {describe(dist)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
