"""``python -m ci.checks.kernel_report``: the command line of :mod:`ci.checks.kernel_report`."""

from __future__ import annotations

import argparse
import os
import sys
import zipfile
from pathlib import Path

from ci.checks.kernel_report import __doc__ as DOC, report_compiled, report_wheel
from ci.runtime.errors import InputError, run_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.checks.kernel_report", description=DOC.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, action="append", default=[], help="read this wheel's cubins instead")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--upstream", type=Path, metavar="CHECKOUT",
                    help="a checkout of thu-ml/SageAttention: its sageattention3_blackwell kernel's budget beside ours")
    ap.add_argument("--cutlass", type=Path, metavar="INCLUDE", help="CUTLASS include dir for --upstream (cute/, cutlass/)")
    args = ap.parse_args(argv)
    if args.upstream and not args.cutlass and not args.wheel:
        ap.error("--upstream needs --cutlass INCLUDE (e.g. nvidia-cutlass's cutlass_library/source/include)")
    return run_main(lambda: _cli(args))


def _cli(args) -> int:
    if args.wheel:
        for w in args.wheel:
            if not w.is_file():
                raise InputError(f"--wheel {w}: no such file; pass a built wheel (e.g. dist/wheels/*.whl)")
            if not zipfile.is_zipfile(w):
                raise InputError(f"--wheel {w}: not a wheel (not a zip archive); pass a built wheel (e.g. dist/wheels/*.whl)")
        return max(report_wheel(w) for w in args.wheel)
    if args.upstream:
        if not args.upstream.is_dir():
            raise InputError(f"--upstream {args.upstream}: no such directory; pass a checkout of thu-ml/SageAttention")
        if not args.cutlass.is_dir():
            raise InputError(f"--cutlass {args.cutlass}: no such directory; pass CUTLASS's include dir (cute/, cutlass/)")
    return report_compiled(args.jobs, (args.upstream, args.cutlass) if args.upstream else None)


if __name__ == "__main__":
    sys.exit(main())
