"""``python -m ci.clean`` (``nox -s clean``): remove what the factory keeps between runs.

Its cache (``$SAGEATTN3_CACHE``, default ``~/.cache/sageattn3-factory``: torch build
environments, CUDA toolkits from PyPI, Pythons it provisioned, CUTLASS, the compiler cache),
``build/`` and ``.nox/`` are all made again on the next run; ``--dist`` also removes ``dist/``
(built wheels and the local index). Imports only the standard library and packaging, so nox's
own interpreter runs it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ci.toolchain import CACHE_MARKER, cache_path, stop_sccache_server

REPO = Path(__file__).resolve().parent.parent


def du(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def clean(places: list[Path], *, dry_run: bool = False, log=print) -> int:
    freed = 0
    for place in places:
        if not place.exists():
            continue
        size = du(place)
        log(f"{'would remove' if dry_run else 'removing'} {place} ({size / 1e9:.2f} GB)")
        if not dry_run:
            shutil.rmtree(place, ignore_errors=True)
        freed += size
    log(f"{'would free' if dry_run else 'freed'} {freed / 1e9:.2f} GB")
    return freed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.clean", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist", action="store_true", help="also remove dist/ (built wheels and the local index)")
    ap.add_argument("--dry-run", action="store_true", help="say what would go and how large it is; remove nothing")
    a = ap.parse_args(argv)
    cache = cache_path()
    if cache.exists() and not (cache / CACHE_MARKER).exists():
        print(f"clean: not removing {cache}: it holds no {CACHE_MARKER} (SAGEATTN3_CACHE names a folder the "
              f"factory did not make); point SAGEATTN3_CACHE at the factory's cache", file=sys.stderr)
        return 2
    if not a.dry_run:
        stop_sccache_server()  # its cache directory is about to go
    clean([cache, REPO / "build", REPO / ".nox"] + ([REPO / "dist"] if a.dist else []), dry_run=a.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
