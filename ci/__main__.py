"""Command line of the factory (``python -m ci <command>``); nox sessions call these."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from packaging.version import Version

from ci.stages.build import REPO
from ci.runtime.errors import run_main
from ci.stages.resolve import default_target, host_os_key, local_blockers
from ci.toolchain.targets import Matrix, MatrixError, Target
from ci.toolchain.variant import torch_line
from ci.toolchain.tools import ToolchainError, find_python


def check_verify_pythons(targets: list[Target], matrix: Matrix, pythons: list[str]) -> None:
    """Refuse, before anything is built, a ``--verify-python`` that cannot verify a target: not
    X.Y, older than the wheel's Requires-Python, or one its verify torch has no build for. Each
    Python left is found or provisioned now (the one-line ToolchainError names the fix)."""
    for py in pythons:
        if not re.fullmatch(r"\d+\.\d+", py):
            raise MatrixError(f"--verify-python {py!r}: expected a CPython version X.Y, e.g. 3.12")
        for t in targets:
            if Version(py) < Version(t.floor_python):
                raise MatrixError(f"--verify-python {py}: {t.id}'s wheel requires Python >={t.floor_python} "
                                  f"(its Requires-Python); pass {t.floor_python} or newer")
            line = matrix.line(torch_line(t.build_torch))
            if py not in line.python:
                raise MatrixError(f"--verify-python {py}: torch {t.build_torch}, which {t.id} is verified with, "
                                  f"is published for Python {', '.join(line.python)} only; pass one of those")
    for py in dict.fromkeys(pythons):
        find_python(py)


def _refuse_windows_here(targets: list[Target]) -> None:
    """A Windows target asked of this Linux machine is built under wine: refuse it before
    anything runs (exit 2) when that cannot work here, saying what to install."""
    from ci.stages.resolve import is_windows_on_linux
    from ci.stages.windows_build import windows_blockers

    for t in targets:
        reasons = windows_blockers(t) if is_windows_on_linux(t.os) else []
        if reasons:
            raise ToolchainError(f"{t.id} cannot be built on this machine: {'; '.join(reasons)}")


def cmd_build_wheels(args: argparse.Namespace) -> int:
    from ci.toolchain.tools import sccache_server_scope

    with sccache_server_scope():
        return _build_wheels(args)


def _build_wheels(args: argparse.Namespace) -> int:
    from ci.stages.pipeline import build_wheels

    matrix = Matrix.load()
    if args.list_targets:
        for t in matrix.targets:
            blockers = local_blockers(t)
            mark = "local" if not blockers else "     "
            print(f"{mark}  {t.describe()}")
        return 0
    if args.target:
        targets = [matrix.target(i) for i in args.target]
    elif args.all_local:
        targets = []
        for t in matrix.targets:
            blockers = local_blockers(t)
            if blockers:
                print(f"skip {t.id}: {'; '.join(blockers)}")
            else:
                targets.append(t)
        if not targets:
            print("no target of the matrix can be built on this machine", file=sys.stderr)
            return 2
    else:
        targets = [default_target(matrix, args.torch)]
    if args.proof_flavour:
        from ci.stages.pipeline import build_proof_wheel

        from ci.toolchain.torch_source import unreachable_reason

        def provable(t: Target) -> bool:  # its torch installs here; its CUDA toolkit need not
            return not t.variant.stable and t.os.key == host_os_key() and unreachable_reason(t) is None

        if args.test_flavour:
            raise MatrixError("--proof-flavour and --test-flavour are exclusive: build one flavour at a time")
        per_torch = [t for t in matrix.targets if provable(t)]
        # Foreign torches for the guard: every other provable per-torch line, and the stable
        # target whose torch installs here (a newer line: the per-torch wheel must refuse it too).
        stable_here = [t for t in matrix.targets if t.variant.stable and not local_blockers(t)][:1]
        for t in targets:
            if not provable(t):
                raise MatrixError(f"{t.id}: the proof flavour needs a per-torch {host_os_key()} target whose torch "
                                  f"installs here; these are: {', '.join(o.id for o in per_torch)}")
            others = [o for o in per_torch if o.torch_lines != t.torch_lines] + stable_here
            rep = build_proof_wheel(t, matrix, Path(args.dist), foreign=others,
                                    force_patches=tuple(args.force_patch or ()))
            print(f"proof-flavour wheel: {rep.wheel}")
        return 0
    if args.test_flavour:
        from ci.stages.pipeline import build_test_wheel

        for t in targets:
            build_test_wheel(t, matrix, Path(args.dist), force_patches=tuple(args.force_patch or ()))
        return 0
    _refuse_windows_here(targets)
    pythons = args.verify_python or ["%d.%d" % sys.version_info[:2]]
    from ci.stages.resolve import is_windows_on_linux

    check_verify_pythons([t for t in targets if not is_windows_on_linux(t.os)], matrix, pythons)
    runs = build_wheels(targets, matrix, Path(args.dist), verify_pythons=pythons, skip_verify=args.no_verify,
                        force_patches=tuple(args.force_patch or ()))
    return 1 if any(r.error for r in runs) else 0


def cmd_matrix(args: argparse.Namespace) -> int:
    if args.check_upstream:
        from ci.release import upstream

        try:
            drift = upstream.check_upstream(Matrix.load(), args.index_url, args.pytorch_index,
                                            log=lambda m: print(m, file=sys.stderr))
        except upstream.UpstreamError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        source = args.index_url + (f" and {args.pytorch_index}" if args.pytorch_index else "")
        report = drift.markdown(source)
        print(report, end="")
        if args.markdown:
            Path(args.markdown).write_text(report)
        return 1 if drift.lines else 0
    print(json.dumps(Matrix.load().gha_matrix(), indent=None if args.compact else 2))
    return 0


def cmd_coverage(args: argparse.Namespace) -> int:
    from ci.checks import coverage

    matrix = Matrix.load()
    if args.record:
        try:
            added = coverage.record_evidence([Path(d) for d in args.record], matrix)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for line in added:
            print(f"evidence: {line}")
    try:
        table = coverage.coverage_table(matrix)
    except coverage.EvidenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.write_docs:
        for path, name, text in ((coverage.COVERAGE_DOC, "coverage", table),
                                 (coverage.README, "matrix", coverage.matrix_brief(matrix))):
            changed = coverage.write_block(path, name, text)
            print(f"{path.relative_to(REPO)} {name} table " + ("updated" if changed else "already current"))
        return 0
    print(table)
    return 0


def cmd_architecture(args: argparse.Namespace) -> int:
    from ci.checks import layers

    if args.write_docs:
        changed = layers.write_docs()
        print(f"{layers.DOC.relative_to(REPO)} layers table " + ("updated" if changed else "already current"))
        return 0
    print(layers.layer_table())
    return 0


def cmd_environment(args: argparse.Namespace) -> int:
    from ci.checks.coverage import write_block
    from ci.runtime.env import DOC_BLOCK, environment_table

    if args.write_docs:
        doc = REPO / "docs" / "factory.md"
        changed = write_block(doc, DOC_BLOCK, environment_table())
        print(f"{doc.relative_to(REPO)} {DOC_BLOCK} table " + ("updated" if changed else "already current"))
        return 0
    print(environment_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    # Progress reaches a CI log (a pipe) as it happens, not in blocks when a buffer fills.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    p = argparse.ArgumentParser(prog="python -m ci", description="sageattn3 wheel factory")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-wheels", help="build, repair, tag, verify and index wheels")
    b.add_argument("--list-targets", action="store_true", help="list target ids ('local': buildable here)")
    b.add_argument("--target", action="append", metavar="ID", help="build this target (repeatable)")
    b.add_argument("--all-local", action="store_true", help="build every target buildable on this machine")
    b.add_argument("--torch", help="default target for this torch version instead of the one pip would install")
    b.add_argument("--verify-python", action="append", metavar="X.Y", help="verify in these Pythons (repeatable)")
    b.add_argument("--no-verify", action="store_true", help="skip the verify stage (never for releases)")
    b.add_argument("--force-patch", action="append", metavar="NAME", help="apply this patch whatever its predicate")
    b.add_argument("--test-flavour", action="store_true",
                   help="build the test flavour (adds sm_90a; FP4 MMA software model) into dist/test/; never published")
    b.add_argument("--proof-flavour", action="store_true",
                   help="per-torch targets compiled with the local CUDA 13 toolkit into dist/proof/, imported "
                        "with their own torch and refused by another; never published")
    b.add_argument("--dist", default=str(REPO / "dist"), help="output root (default: dist/)")
    b.set_defaults(fn=cmd_build_wheels)
    m = sub.add_parser("matrix", help="print the GitHub Actions matrix JSON")
    m.add_argument("--compact", action="store_true")
    m.add_argument("--check-upstream", action="store_true",
                   help="compare ci/targets.toml with the torch releases an index serves (exit 1: differences)")
    m.add_argument("--index-url", default="https://pypi.org/simple", help="simple index to compare with (default: PyPI)")
    m.add_argument("--pytorch-index", metavar="ROOT",
                   help="also compare the CUDA variants with PyTorch's index (e.g. https://download.pytorch.org/whl)")
    m.add_argument("--markdown", metavar="FILE", help="also write the report to FILE (an issue body)")
    m.set_defaults(fn=cmd_matrix)
    c = sub.add_parser("coverage", help="print the coverage table (markdown), proven levels from ci/evidence.json")
    c.add_argument("--record", action="append", metavar="DIR",
                   help="add the build records in DIR (dist/wheels, dist/proof) to ci/evidence.json")
    c.add_argument("--write-docs", "--write-readme", dest="write_docs", action="store_true",
                   help="write the table into docs/coverage.md and the brief matrix into README.md "
                        "(--write-readme: its name from when the table was in the README)")
    c.set_defaults(fn=cmd_coverage)
    a = sub.add_parser("architecture", help="print the layers of ci/ (markdown), from ci/checks/layers.py")
    a.add_argument("--write-docs", action="store_true", help="write the table into docs/architecture.md")
    a.set_defaults(fn=cmd_architecture)
    e = sub.add_parser("environment", help="print the variables the factory reads (markdown), from ci/runtime/env.py")
    e.add_argument("--write-docs", action="store_true", help="write the table into docs/factory.md")
    e.set_defaults(fn=cmd_environment)
    args = p.parse_args(argv)
    return run_main(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
