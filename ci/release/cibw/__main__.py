"""``python -m ci.release.cibw``: the command line of :mod:`ci.release.cibw`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script ({project}/ci/release/cibw/__main__.py) inside a container
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ci.release.cibw import REPO, build_into, collect, install_cuda, install_cuda_plan, load_target, repair_into, verify_wheel  # noqa: E402
from ci.release.cibw_job import check_job, factory_requirements, job_env, plan_job  # noqa: E402
from ci.release.runner_setup import free_disk, msvc_env  # noqa: E402
from ci.toolchain.targets import Matrix  # noqa: E402
from ci.runtime.env import FactoryEnv  # noqa: E402
from ci.runtime.errors import FactoryError, InputError, run_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.release.cibw", description="cibuildwheel's hooks into the factory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="KEY=VALUE lines a release job exports for a target")
    e.add_argument("--target", required=True)
    sub.add_parser("free-disk", help="remove the runner's preinstalled software no build uses")
    pj = sub.add_parser("plan", help="what each step of a target's release job runs (no build)")
    pj.add_argument("--target", action="append", help="target id (repeatable; default: all)")
    c = sub.add_parser("install-cuda", help="install the target's CUDA toolkit (before-all / a Windows step)")
    c.add_argument("--target")
    c.add_argument("--github-env", type=Path, default=FactoryEnv.from_environ().github_env)
    c.add_argument("--dry-run", action="store_true", help="print what it would run (as a bash script), run nothing")
    m = sub.add_parser("msvc-env", help="export VS 2022 x64 developer variables to $GITHUB_ENV")
    m.add_argument("--github-env", type=Path, default=FactoryEnv.from_environ().github_env)
    q = sub.add_parser("requirements", help="the factory's requirements for this (or another) platform")
    q.add_argument("--platform", choices=["linux", "windows"],
                   default="windows" if sys.platform == "win32" else "linux")
    b = sub.add_parser("build", help="build stage into a directory (the PEP 517 shim calls this)")
    b.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("repair", help="repair + tag stage (cibuildwheel repair-command)")
    r.add_argument("--wheel", type=Path, required=True)
    r.add_argument("--dest-dir", type=Path, required=True)
    v = sub.add_parser("verify", help="verify stage (cibuildwheel test-command)")
    v.add_argument("--wheel", type=Path, required=True)
    v.add_argument("--python", action="append", help="verify in this Python (repeatable; default: the target's)")
    v.add_argument("--python-exe", help="the interpreter of the Python verify runs in (cibuildwheel's test "
                                        "`python`), instead of finding one")
    k = sub.add_parser("collect", help="cibuildwheel's output dir -> dist/wheels with build records")
    k.add_argument("--wheelhouse", type=Path, required=True)
    k.add_argument("--out", type=Path, default=REPO / "dist" / "wheels")
    k.add_argument("--target")
    a = ap.parse_args(argv)
    # cibuildwheel's hooks run with stdout on a pipe: one line at a time, not one burst at the end
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    target = FactoryEnv.from_environ().target or getattr(a, "target", None) or "?"
    return run_main(lambda: _cli(a), prefix=f"error ({target})")


def _cli(a) -> int:
    """One hook; whatever it raises becomes one line naming the target and the error's class, then
    exit status 2 for bad input (an InputError: a target, a matrix entry, a missing tool), else 1."""
    try:
        return _run(a)
    except Exception as e:  # noqa: BLE001 - never a traceback from a hook: one line, then non-zero
        raise (InputError if isinstance(e, InputError) else FactoryError)(f"{type(e).__name__}: {e}") from e


def _run(a) -> int:
    if a.cmd == "env":
        _, t = load_target(a.target)
        for key, val in job_env(t).items():
            print(f"{key}={val}")
    elif a.cmd == "free-disk":
        free_disk()
    elif a.cmd == "plan":
        matrix = Matrix.load()
        bad = 0
        for t in [matrix.target(i) for i in a.target] if a.target else matrix.targets:
            job = plan_job(t, matrix)
            problems = check_job(job, matrix)
            bad += bool(problems)
            print(job.describe() + "".join(f"\n  PROBLEM {p}" for p in problems))
        return 1 if bad else 0
    elif a.cmd == "install-cuda" and a.dry_run:
        t = load_target(a.target)[1]
        print(install_cuda_plan(t), end="")
    elif a.cmd == "install-cuda":
        install_cuda(load_target(a.target)[1], a.github_env)
    elif a.cmd == "msvc-env":
        changed = msvc_env()
        if a.github_env:
            with open(a.github_env, "a", encoding="utf-8") as f:
                f.writelines(f"{k}={v}\n" for k, v in changed.items())
        print(f"exported {len(changed)} variables of the VS 2022 x64 toolset")
    elif a.cmd == "requirements":
        print("\n".join(factory_requirements(a.platform)))
    elif a.cmd == "build":
        print(build_into(a.out))
    elif a.cmd == "repair":
        repair_into(a.wheel, a.dest_dir)
    elif a.cmd == "verify":
        verify_wheel(a.wheel, a.python, a.python_exe)
    elif a.cmd == "collect":
        collect(a.wheelhouse, a.out, a.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
