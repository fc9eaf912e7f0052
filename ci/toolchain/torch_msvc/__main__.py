"""``python -m ci.toolchain.torch_msvc WHEEL...``: the command line of :mod:`ci.toolchain.torch_msvc`."""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

from ci.runtime.errors import InputError, run_main
from ci.toolchain.torch_msvc import status_in_wheel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.toolchain.torch_msvc",
                                 description="Whether each torch wheel's compiled_autograd.h trips MSVC's C2872 "
                                             "(absent, fenced-off, guarded or needs-patch).")
    ap.add_argument("wheels", nargs="*", type=Path, metavar="WHEEL", help="a torch wheel file")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a.wheels))


def _cli(wheels: list[Path]) -> int:
    for w in wheels:
        if not w.is_file() or not zipfile.is_zipfile(w):
            raise InputError(f"{w}: no such wheel; pass torch wheel files (e.g. from `pip download torch --no-deps`)")
        print(f"{w.name}: {status_in_wheel(w)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
