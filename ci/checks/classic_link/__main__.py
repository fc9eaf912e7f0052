"""``python -m ci.checks.classic_link``: the command line of :mod:`ci.checks.classic_link`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ci.checks.classic_link import _classic_targets, link_classic
from ci.runtime.errors import InputError, run_main
from ci.toolchain.cross import resolve_cross
from ci.toolchain.cross_spec import is_cross
from ci.toolchain.tools import ToolchainError


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ci.checks.classic_link", description="cross-compiling Linux targets of another machine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tc = sub.add_parser("toolchain", help="provision and print the cross toolchain of a target")
    tc.add_argument("--target", required=True, metavar="ID")
    lc = sub.add_parser("link-classic", help="cross-compile and link the classic unit of per-torch targets whose "
                                             "target-machine torch on PyPI is a CPU build")
    lc.add_argument("--target", action="append", metavar="ID", help="default: every such target of the matrix")
    lc.add_argument("--work", default="build/cross-classic", help="where objects and modules go")
    lc.add_argument("--kernel-objects", metavar="DIR",
                    help="link the kernel units' aarch64 objects found under DIR (**/*.cu.o), e.g. the staging "
                         "dir of the stable wheel's cross build (the kernel units include no torch header)")
    lc.add_argument("--record", action="store_true", help="add the results to ci/evidence.json")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a))


def _cli(a) -> int:
    try:
        return _run(a)
    except InputError:  # a target, the matrix, a missing tool: exit status 2
        raise
    except ValueError as e:  # any other bad value on the way is bad input too
        raise InputError(str(e)) from e


def _run(a) -> int:
    from ci.toolchain.targets import Matrix

    matrix = Matrix.load()
    if a.cmd == "toolchain":
        t = matrix.target(a.target)
        if not is_cross(t.os):
            raise ToolchainError(f"{t.id} is this machine's own target: no cross toolchain needed")
        print(json.dumps(resolve_cross(t.os.machine, t.cuda, t.build_torch).record(), indent=2))
        return 0
    from ci.checks import coverage

    for t in _classic_targets(matrix, a.target):
        kernels = sorted(Path(a.kernel_objects).rglob("*.cu.o")) if a.kernel_objects else []
        if a.kernel_objects and not kernels:
            raise ToolchainError(f"no *.cu.o under {a.kernel_objects}")
        link = link_classic(t, matrix, Path(a.work) / t.id, kernel_objects=kernels)
        print(json.dumps(link.to_dict(), indent=2))
        if a.record:
            print(f"evidence: {coverage.record_classic_link(link.to_dict(), matrix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
