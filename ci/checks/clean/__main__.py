"""``python -m ci.checks.clean``: the command line of :mod:`ci.checks.clean`."""

from __future__ import annotations

import argparse
import sys

from ci.checks.clean import __doc__ as DOC, REPO, clean
from ci.runtime.errors import InputError, run_main
from ci.toolchain.tools import CACHE_MARKER, cache_path, stop_sccache_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.checks.clean", description=DOC.split("\n\n")[0])
    ap.add_argument("--dist", action="store_true", help="also remove dist/ (built wheels and the local index)")
    ap.add_argument("--dry-run", action="store_true", help="say what would go and how large it is; remove nothing")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a), prefix="clean")


def _cli(a) -> int:
    cache = cache_path()
    if cache.exists() and not (cache / CACHE_MARKER).exists():
        raise InputError(f"not removing {cache}: it holds no {CACHE_MARKER} (SAGEATTN3_CACHE names a folder the "
                         f"factory did not make); point SAGEATTN3_CACHE at the factory's cache")
    if not a.dry_run:
        stop_sccache_server()  # its cache directory is about to go
    clean([cache, REPO / "build", REPO / ".nox"] + ([REPO / "dist"] if a.dist else []), dry_run=a.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
