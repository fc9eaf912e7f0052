"""``python -m ci.release.docs_site``: the command line of :mod:`ci.release.docs_site`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ci.release.docs_site import __doc__ as DOC, SITE_DIR, write_site
from ci.runtime.errors import run_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.release.docs_site", description=DOC.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("dist/index"),
                    help="the index root; the pages go to OUT/docs/ (default: dist/index)")
    ap.add_argument("--repo", metavar="OWNER/NAME",
                    help="link repository files to this GitHub repository (default: plain text)")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a), prefix="docs")


def _cli(a) -> int:
    written = write_site(a.out, a.repo)
    print(f"docs: {len(written)} pages written under {a.out / SITE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
