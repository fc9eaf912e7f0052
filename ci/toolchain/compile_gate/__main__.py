"""``python -m ci.toolchain.compile_gate``: the command line of :mod:`ci.toolchain.compile_gate`."""

from __future__ import annotations

import argparse
import sys

from ci.runtime.errors import run_main
from ci.toolchain.compile_gate import __doc__ as DOC, failures_message, run_gate
from ci.toolchain.targets import Matrix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.toolchain.compile_gate", description=DOC.split("\n\n")[0])
    ap.add_argument("--line", action="append", help="only this torch line (repeatable)")
    ap.add_argument("--jobs", type=int)
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a))


def _cli(a) -> int:
    matrix = Matrix.load()
    results = run_gate(matrix, a.line, a.jobs)
    msg = failures_message(matrix, results)
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        return 1
    print(f"[gate] all {len(results)} torch lines compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
