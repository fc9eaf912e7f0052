"""``python -m ci.checks.clean`` (``nox -s clean``): remove what the factory keeps between runs.

Its cache (``$SAGEATTN3_CACHE``, default ``~/.cache/sageattn3-factory``: torch build
environments, CUDA toolkits from PyPI, Pythons it provisioned, CUTLASS, the compiler cache),
``build/`` and ``.nox/`` are all made again on the next run; ``--dist`` also removes ``dist/``
(built wheels and the local index). Imports only the standard library and packaging, so nox's
own interpreter runs it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ci.runtime.log import default_log


REPO = Path(__file__).resolve().parents[3]


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


def clean(places: list[Path], *, dry_run: bool = False, log=default_log) -> int:
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
