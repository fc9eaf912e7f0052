"""``python -m ci.release.standin_image``: the command line of :mod:`ci.release.standin_image`."""

from __future__ import annotations

import argparse
import sys

from ci.release.standin_image import __doc__ as DOC, build_image, image_name
from ci.runtime.errors import run_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.release.standin_image", description=DOC.split("\n\n")[0])
    ap.add_argument("--print-name", action="store_true", help="print the name the image has or would have; build nothing")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a), prefix="standin-image")


def _cli(a) -> int:
    if a.print_name:
        print(image_name())
    else:
        print(build_image(log=lambda m: print(m, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
