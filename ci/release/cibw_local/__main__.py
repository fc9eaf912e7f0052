"""``python -m ci.release.cibw_local``: the command line of :mod:`ci.release.cibw_local`."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from ci.release.cibw_local import __doc__ as DOC, REPO, run_cibuildwheel
from ci.runtime.errors import FactoryError, InputError, run_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.release.cibw_local", description=DOC.split("\n\n")[0])
    ap.add_argument("--target", default="linux-x86_64-cu130-torch2.10-stable", help="a Linux target of this machine's arch")
    ap.add_argument("--payload-dir", type=Path, metavar="DIR",
                    help="a payload project inside the repository whose cibw_stages.py the hooks run instead of "
                         "the factory's stages on sageattn3/ (default), e.g. tests/cibw_probe (a one-file extension)")
    ap.add_argument("--output-dir", type=Path, default=REPO / "dist" / "cibuildwheel")
    ap.add_argument("--jobs", type=int, help="MAX_JOBS, the parallel compiles (default: what memory holds)")
    ap.add_argument("--cache", type=Path, help="the runner's cache folder (default: the factory's cache; a "
                                                "private one keeps other builds on this machine out of the way)")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a), prefix=None)  # each message names itself: "cibuildwheel ..."


def _cli(a) -> int:
    from ci.release.cibw_local import LocalCibwError, payload_relative
    from ci.toolchain.targets import Matrix, MatrixError

    if a.payload_dir is not None:
        try:
            payload_relative(a.payload_dir)
        except LocalCibwError as e:
            raise InputError(f"cibuildwheel: --payload-dir {e}") from e

    try:
        target = Matrix.load().target(a.target)
    except MatrixError as e:
        raise InputError(f"cibuildwheel: {e}") from e
    if target.os.platform != "linux" or target.os.machine != platform.machine():
        raise InputError(f"cibuildwheel: {a.target} is a {target.os.key} target; this runs Linux containers of this "
                         f"machine's arch ({platform.machine()}): pass a linux-{platform.machine()} target")
    from ci.release.cibw_local import cannot_run
    from ci.release.standin_image import PYTHONS

    # another payload brings its own build (no CUDA, no torch): only the image's Pythons matter then
    why = cannot_run(target) if a.payload_dir is None else (
        "" if target.python in PYTHONS else f"the stand-in manylinux image holds Pythons {', '.join(PYTHONS)}; "
                                            f"this job builds with {target.python}")
    if why:
        raise InputError(f"cibuildwheel: {a.target} cannot run here: {why}")
    try:
        run = run_cibuildwheel(a.target, a.output_dir / a.target, payload_dir=a.payload_dir, jobs=a.jobs, cache=a.cache)
    except Exception as e:  # noqa: BLE001 - one line, then exit status 1, whatever failed in the run
        raise FactoryError(f"cibuildwheel ({a.target}): {type(e).__name__}: {e}") from e
    for w in run.wheels:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
