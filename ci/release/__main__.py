"""``python -m ci.release``: the release pipeline's steps and its dry run (see ci.release).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ci.release
from ci.runtime.errors import run_main
from ci.release import REPO, ReleaseError, ReleaseInputError
from ci.release.rehearsal import dry_run
from ci.release.steps import check_tag, compile_gate_problem, gather_release, plan, report
from ci.release.workflow_lint import lint_workflows
from ci.toolchain.targets import Matrix
from ci.runtime.env import FactoryEnv
from ci.stages.provenance import FAILED_STEPS_HELP


# -- CLI --------------------------------------------------------------------------------------

def _read_json_arg(value: str) -> dict:
    """A JSON document given inline, as @file, or '-' (stdin); bad JSON or a missing file is an
    input error naming the argument."""
    where = "stdin" if value == "-" else value[1:] if value.startswith("@") else "the argument"
    try:
        if value == "-":
            return json.load(sys.stdin)
        if value.startswith("@"):
            return json.loads(Path(value[1:]).read_text())
        return json.loads(value)
    except OSError as e:
        raise ReleaseInputError(f"cannot read the JSON file {where}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ReleaseInputError(f"not JSON ({where}): {e.msg} at line {e.lineno} column {e.colno}; give a JSON "
                                "document inline, as @FILE, or - for stdin") from None


def _outcome(a) -> int:
    """``target_<id>=sha256:<hex>`` or ``=failed:<step>`` to $GITHUB_OUTPUT (and stdout)."""
    from ci.stages.provenance import ProvenanceError, output_key, outcome_value

    status = 0
    try:
        value = outcome_value(a.target, a.steps, a.artifact)
    except ProvenanceError as e:
        print(f"release outcome: {e}", file=sys.stderr)
        value, status = "failed:outcome", 2
    line = f"{output_key(a.target)}={value}"
    print(line)
    if a.outcome_dir:  # the outcome-<id> artifact: how a failed leg's step reaches the publish job
        a.outcome_dir.mkdir(parents=True, exist_ok=True)
        (a.outcome_dir / output_key(a.target)).write_text(value + "\n", encoding="utf-8")
    if a.github_output:
        with open(a.github_output, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return status


def main(argv: list[str] | None = None) -> int:
    env = FactoryEnv.from_environ()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--dry-run":  # `nox -s release -- --dry-run`
        argv[0] = "dry-run"
    ap = argparse.ArgumentParser(prog="python -m ci.release", description=ci.release.__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="check the matrix JSON (nox -s matrix) and print the build jobs' matrix")
    p.add_argument("--matrix", default="-", help="JSON, @file or - (stdin; default)")
    p.add_argument("--targets", default="", help="comma-separated target ids to build (default: all)")
    p.add_argument("--github-output", type=Path, default=env.github_output)
    p.add_argument("--no-compile-gate", action="store_true",
                   help="skip compiling each torch line's unit against its torch headers (ci.toolchain.compile_gate)")
    r = sub.add_parser("report", help="which planned targets built (markdown; exit 1 when any failed)")
    r.add_argument("--plan", required=True, help="the plan JSON, @file or -")
    r.add_argument("--artifacts", type=Path, required=True)
    r.add_argument("--tag", default=env.github_ref_name)
    r.add_argument("--summary", type=Path, default=env.github_step_summary)
    g = sub.add_parser("gather", help="every planned target's artifact into dist/wheels, or nothing")
    g.add_argument("--plan", required=True)
    g.add_argument("--artifacts", type=Path, required=True)
    g.add_argument("--out", type=Path, default=REPO / "dist" / "wheels")
    g.add_argument("--build-outputs", default=None, metavar="JSON",
                   help="the build jobs' outputs (toJSON(needs.build.outputs)): every wheel must be the one its job "
                        "verified; targets whose job failed are left out and named (a partial release)")
    g.add_argument("--failed-steps", type=Path, default=None, metavar="DIR",
                   help=FAILED_STEPS_HELP)
    sub.add_parser("workflow-outputs", help="the per-target output lines of build-target.yml (ci.stages.provenance)")
    oc = sub.add_parser("outcome", help="a build job's output for the publish job: its verified wheel's sha256, "
                                        "or the step that failed (ci.stages.provenance)")
    oc.add_argument("--target", required=True)
    oc.add_argument("--steps", required=True, help="toJSON(steps) of the job")
    oc.add_argument("--artifact", type=Path, required=True, help="the directory the job uploads as its artifact")
    oc.add_argument("--github-output", type=Path, default=env.github_output)
    oc.add_argument("--outcome-dir", type=Path, default=None,
                    help="also write the value to DIR/<output key> (uploaded as the outcome-<id> artifact)")
    pg = sub.add_parser("pages", help="publish the built index to the Pages branch (python -m ci.release.publish pages)")
    pg.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("lint-workflows", help="actionlint + zizmor on .github/workflows")
    ct = sub.add_parser("check-tag", help="the tag must be v + the package version")
    ct.add_argument("--tag", required=True)
    d = sub.add_parser("dry-run", help="the whole pipeline for the targets buildable here, publishing locally")
    d.add_argument("--dist", type=Path, default=REPO / "dist" / "dry-run")
    d.add_argument("--verify-python", action="append", metavar="X.Y")
    d.add_argument("--repo", default="sageattn3/sageattn3")
    d.add_argument("--tag", default=None)
    d.add_argument("--only", action="append", metavar="TARGET", help="rehearse only this target (repeatable)")
    d.add_argument("--plan-only", action="store_true", help="resolve and check every job, build nothing")
    d.add_argument("--fail-target", action="append", metavar="TARGET",
                   help="make this target's build job fail at its cibuildwheel step (any target of the matrix; "
                        "repeatable): rehearses a partial release, the others published and this one named")
    a = ap.parse_args(argv)
    return run_main(lambda: _cli(a), prefix="release")


def _cli(a) -> int:
    if a.cmd == "plan":
        out = plan(_read_json_arg(a.matrix), only=[t for t in a.targets.split(",") if t.strip()])
        gate_problem = None if a.no_compile_gate else compile_gate_problem(Matrix.load(), log=lambda m: print(m, file=sys.stderr))
        if gate_problem:
            raise ReleaseError(f"refusing the matrix: {gate_problem}")
        text = json.dumps(out, separators=(",", ":"))
        if a.github_output:
            with open(a.github_output, "a", encoding="utf-8") as f:
                f.write(f"matrix={text}\n")
        print(text)
        print(f"plan: {len(out['include'])} build job(s)", file=sys.stderr)
    elif a.cmd == "report":
        md, missing = report(_read_json_arg(a.plan), a.artifacts, a.tag)
        print(md)
        if a.summary:
            with open(a.summary, "a", encoding="utf-8") as f:
                f.write(md + "\n")
        return 1 if missing else 0
    elif a.cmd == "gather":
        from ci.stages.provenance import json_argument, with_failed_steps

        outputs = with_failed_steps(json_argument(a.build_outputs, "--build-outputs", ReleaseInputError), a.failed_steps)
        got = gather_release(_read_json_arg(a.plan), a.artifacts, a.out, outputs)
        print(f"gathered {len(got.wheels)} wheel(s) into {a.out}")
        for target, why in got.missing.items():
            print(f"  not published: {target}: {why}")
    elif a.cmd == "outcome":
        return _outcome(a)
    elif a.cmd == "workflow-outputs":
        from ci.stages.provenance import workflow_outputs

        call, job = workflow_outputs([t.id for t in Matrix.load().targets])
        print("# on.workflow_call.outputs:\n" + "\n".join(call) + "\n# jobs.build.outputs:\n" + "\n".join(job))
    elif a.cmd == "pages":
        from ci.release.publish.__main__ import main as publish_main

        return publish_main(["pages", *a.args])
    elif a.cmd == "lint-workflows":
        problems = lint_workflows()
        for name, rc, out in problems:
            print(f"--- {name} (exit {rc})\n{out}")
        print("workflows: " + ("actionlint and zizmor found nothing" if not problems else
                               f"{len(problems)} tool(s) complained"))
        return 1 if problems else 0
    elif a.cmd == "check-tag":
        print(f"tag {a.tag} matches sageattn3 {check_tag(a.tag)}")
    elif a.cmd == "dry-run":
        dr = dry_run(a.dist, verify_pythons=a.verify_python, repo=a.repo, tag=a.tag, only=a.only,
                     plan_only=a.plan_only, fail_targets=a.fail_target)
        print("\n" + dr.summary)
        if dr.missing:
            print(f"dry run: a partial release: {len(dr.wheels)} target(s) published, {len(dr.missing)} missing "
                  f"({', '.join(dr.missing)}); artifacts in {a.dist}", file=sys.stderr)
            return 1
        print(f"dry run complete: artifacts in {a.dist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
