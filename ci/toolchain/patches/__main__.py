"""``python -m ci.toolchain.patches``: the command line of :mod:`ci.toolchain.patches`."""

from __future__ import annotations

from pathlib import Path

from ci.runtime.errors import run_main
from ci.toolchain.patches import check_patch, load_manifest, pristine_roots, select


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ci.toolchain.patches")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="every patch applies, is idempotent and reverses, against its pins")
    ls = sub.add_parser("list", help="what a target gets")
    ls.add_argument("--target", required=True)
    args = ap.parse_args(argv)

    def command() -> int:  # inside main: what only the command line runs
        import tempfile

        from ci.toolchain.flags import compiler_for
        from ci.toolchain.targets import Matrix

        patches = load_manifest()
        if args.cmd == "list":
            t = Matrix.load().target(args.target)
            chosen = select(patches, os_key=t.os.key, compiler=compiler_for(t), cuda=t.cuda, torch_version=t.build_torch)
            print(f"{t.id}: {len(chosen)} patch(es)")
            for p in chosen:
                print(f"  {p.describe()}")
            return 0
        from ci.toolchain.tools import cutlass_include

        roots = pristine_roots(cutlass_include=cutlass_include())
        failed = 0
        for p in patches:
            with tempfile.TemporaryDirectory() as tmp:
                problems = check_patch(p, roots, Path(tmp))
            print(("FAIL " if problems else "ok   ") + p.describe())
            for msg in problems:
                print(f"     {msg}")
            failed += bool(problems)
        print(f"{len(patches) - failed} passed, {failed} failed")
        return 1 if failed else 0

    return run_main(command)


if __name__ == "__main__":
    raise SystemExit(main())
