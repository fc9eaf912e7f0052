"""``python -m ci.index [build|check]``: merge wheels into the index, or crawl one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from ci.index.check import check_index
from ci.index.layout import DEFAULT_PROJECT, IndexError_
from ci.index.write import update_index
from ci.runtime.errors import FactoryError, InputError, run_main
from ci.stages.record import RecordError, load_records
from ci.stages.provenance import FAILED_STEPS_HELP


def _build(a) -> int:
    if a.wheels is None and (a.remove or a.yank):
        records, wheels = [], Path("dist/wheels")  # only removing/yanking: no wheels needed
    else:
        wheels = a.wheels or Path("dist/wheels")
        records = load_records(wheels, a.project)
    yank = {}
    for y in a.yank:
        w, _, reason = y.partition("=")
        if not w.endswith(".whl"):
            raise IndexError_(f"--yank {y!r}: expected WHEEL=REASON with the wheel's file name (…whl=why)")
        yank[w] = reason
    missing = None
    if a.plan is not None:  # a release's index: the planned targets without a wheel are named on it
        from ci.stages.provenance import missing_targets

        from ci.stages.provenance import with_failed_steps

        outputs = with_failed_steps(_json_arg(a.build_outputs, "--build-outputs"), a.failed_steps)
        missing = missing_targets(records, outputs, _json_arg(a.plan, "--plan"))
    elif a.build_outputs is not None:
        raise IndexError_("--build-outputs needs --plan (the targets of the release)")
    r = update_index(records, wheels, a.out, a.project, base_url=a.base_url, remove=a.remove, yank=yank,
                     missing=missing)
    print(f"index {a.out}: {len(r.pages)} pages, +{len(r.added)} wheels, -{len(r.removed)} wheels, "
          f"{len(r.written)} files written, {len(r.deleted)} deleted")
    for target, why in sorted((missing or {}).items()):
        print(f"  not in this release yet (named on the index page): {target}: {why}")
    return 0


def _json_arg(value: str | None, option: str):
    from ci.stages.provenance import json_argument

    return json_argument(value, option, IndexError_)


def _check(a) -> int:
    try:
        check_index(a.location)
    except IndexError_ as e:  # an index that is there and wrong: the crawl failed (exit status 1)
        raise FactoryError(f"index check: {e}") from e
    except (OSError, ValueError, KeyError) as e:  # unreachable, missing, not an index
        why = getattr(e, "reason", None) or e
        raise InputError(f"index check: cannot read an index at {a.location} ({type(e).__name__}: {why}); "
                         "pass the index root (the directory or URL holding index.json)") from e
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in ("build", "which", "check") else "build"
    # each message names itself ("index: ...", "index check: ...")
    return run_main(lambda: _cli(cmd, argv), prefix=None)


def _cli(cmd: str, argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m ci.index {cmd}")
    if cmd == "which":
        raise InputError("python -m ci.index which is gone: where torch is installed, run `python -m sageattn3 which`, "
                         "or paste your torch version into the index's picker page (index.html)")
    if cmd == "build":
        ap.description = "Merge the wheels of a directory into a PEP 503/658 index (see ci/index/__init__.py for the layout)."
        ap.add_argument("--wheels", type=Path, default=None,
                        help="wheels with their <wheel>.json records (default dist/wheels; must exist and hold wheels)")
        ap.add_argument("--out", type=Path, default=Path("dist/index"), help="the index root (merged into when it exists)")
        ap.add_argument("--base-url", default=None, help="the URL the index root is served at (shown on the picker page)")
        ap.add_argument("--project", default=DEFAULT_PROJECT)
        ap.add_argument("--remove", action="append", default=[], metavar="WHEEL_OR_VERSION",
                        help="drop a wheel (file name) or a version (1.0.0 = every variant of it); repeatable")
        ap.add_argument("--yank", action="append", default=[], metavar="WHEEL=REASON", help="mark a wheel yanked (PEP 592)")
        ap.add_argument("--plan", default=None, metavar="JSON",
                        help="the release's planned targets (or @file): those without a wheel are named on the index "
                             "page until a wheel of each is indexed")
        ap.add_argument("--build-outputs", default=None, metavar="JSON",
                        help="the build jobs' outputs (toJSON(needs.build.outputs), or @file): why each is missing")
        ap.add_argument("--failed-steps", default=None, metavar="DIR",
                        help=FAILED_STEPS_HELP)
        run = _build
    else:
        ap.description = "Crawl an index (URL or directory): every link, sha256 and .metadata."
        ap.add_argument("location")
        run = _check
    a = ap.parse_args(argv)
    try:
        return run(a)
    except (IndexError_, RecordError, ValueError) as e:  # bad input (also a malformed --build-outputs): nothing written
        raise InputError(f"index: {e}") from e
    except OSError as e:
        raise FactoryError(f"index: {e.strerror or e}: {e.filename or ''} (nothing half-written is left: files are "
                           f"replaced whole)") from e


if __name__ == "__main__":
    sys.exit(main())
