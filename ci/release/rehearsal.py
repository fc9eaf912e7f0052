"""The release rehearsal (``python -m ci.release dry-run``): every target's job planned and
checked, the torch specs of the served targets resolved, the targets buildable here built by
the pinned cibuildwheel for real, then gather, publish to a local GitHub-REST server, index and
Pages, and a summary.

Each build job runs as the release runs it: ``ci.release.cibw_local`` calls the pinned
cibuildwheel with ci/cibuildwheel.toml and the job's environment, in a container of the stand-in
manylinux image, so before-all, the build through the shim, the repair-wheel-command, the abi3
audit and the test-command are cibuildwheel's own (that module's docstring lists the few
replacements this machine needs). The rehearsal itself keeps only what a cibuildwheel run does not
cover, and says so:

    plan           every target's job resolved and checked, also those this machine cannot
                   build (CUDA 12.x, Windows, aarch64), and each Windows job's MSVC commands
    torch specs    for every other target the stand-in serves, its build and guard torch
                   resolved by real pip in its floor Python
    collect        build-target.yml's step after cibuildwheel (``python -m ci.release.cibw collect``)
    outcomes       each job's outcome as build-target.yml makes it, a failed job included
                   (``--fail-target``), passed on as GitHub passes a matrix's outputs
    publish        gather, SHA256SUMS, the GitHub Release on a local GitHub-REST server, the
                   index and the Pages branch, as the publish job runs them
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ci.runtime.errors import FactoryError
from ci.runtime.log import default_log
from ci.runtime.pip_env import pip_environ
from ci.release import REPO, ReleaseError, ReleaseInputError
from ci.release.github_standin import GitHubStandin
from ci.release.standin import fetch_torch, pytorch_index_standin, standin_needs, standin_serves
from ci.release.steps import (ARTIFACT_PREFIX, check_tag, compile_gate_problem, gather_release, plan, publish_steps,
                              report, rerun_hint, sha256sums)
from ci.stages.provenance import with_failed_steps
from ci.release.torch_resolution import resolve_served_targets, standin_resolutions
from ci.toolchain.targets import Matrix


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
    jobs: list = field(default_factory=list)  # TargetRehearsal per target
    resolutions: list = field(default_factory=list)  # TorchResolution per served target and role
    failed_steps: dict[str, str] = field(default_factory=dict)  # target -> the build job's step that failed
    missing: dict[str, str] = field(default_factory=dict)  # target -> why the release lacks it (as the notes say)

    @property
    def artifacts(self) -> Path:
        return self.dist / "artifacts"


def rehearse_target(target_id: str, dist: Path, artifacts: Path, *, pytorch_index: str,
                    verify_pythons: list[str] | None = None, log=default_log) -> dict[str, float]:
    """One release build job here: the pinned cibuildwheel with ci/cibuildwheel.toml and the
    job's environment (``ci.release.cibw_local``, in the stand-in manylinux image), with
    ``pytorch_index`` in place of PyTorch's, then build-target.yml's collect step into the
    artifact directory ``wheel-<id>``. Returns each step's seconds (cibuildwheel's, as its log
    gives them, and collect)."""
    from ci.release.cibw_local import run_cibuildwheel

    floor = Matrix.load().target(target_id).python
    if verify_pythons and floor not in verify_pythons:
        raise ReleaseError(f"{target_id}: --verify-python {' '.join(verify_pythons)} leaves out {floor}, the Python "
                           f"cibuildwheel tests the wheel with (the target's floor): add --verify-python {floor}")
    try:
        run = run_cibuildwheel(target_id, dist / "cibw" / target_id, pytorch_index=pytorch_index,
                               verify_pythons=verify_pythons, log=log)
    except FactoryError as e:
        raise ReleaseError(f"{target_id}: {e}") from e
    times = run.step_seconds()
    dest = artifacts / f"{ARTIFACT_PREFIX}{target_id}"
    shutil.rmtree(dest, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ci.release.cibw", "collect", "--wheelhouse",
                           str(run.output_dir / "wheelhouse"), "--out", str(dest), "--target", target_id],
                          cwd=REPO, capture_output=True, text=True, env=pip_environ(sources=False))
    if proc.returncode != 0:
        raise ReleaseError(f"{target_id}: collect exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    times["collect"] = time.monotonic() - t0
    for line in run.lines("[verify]"):
        log(line)
    return times


@dataclass
class TargetRehearsal:
    """One target in the rehearsal: its job resolved and checked, and whether it ran here."""

    id: str
    job: object  # ci.release.cibw_job.JobPlan
    problems: list[str]
    runs_here: bool
    why_not: str = ""


def rehearse_plan(matrix: Matrix, pytorch_index: str | None = None, log=default_log) -> list[TargetRehearsal]:
    """Every target's release job resolved (environment, torch and guard sources, CUDA install,
    cibuildwheel selection, each step's command) and checked; which of them can run here
    with the stand-in index and the pinned cibuildwheel in the stand-in manylinux image (a
    Linux target of this machine's arch whose CUDA comes from PyPI; the rest are only planned,
    with the reason)."""
    from ci.release import cibw_job
    from ci.release.cibw_local import cannot_run
    from ci.stages.resolve import local_blockers

    out = []
    for t in matrix.targets:
        job = cibw_job.plan_job(t, matrix)
        problems = cibw_job.check_job(job, matrix) + _windows_commands_problems(t, matrix)
        blockers = local_blockers(t, pytorch_index=pytorch_index or "http://127.0.0.1/whl")  # the stand-in's
        why_not_here = "" if blockers else cannot_run(t)  # the container's own limits (image, podman)
        if why_not_here:
            blockers.append(why_not_here)
        served = standin_serves(t, matrix)
        why = "; ".join(blockers + ([f"the stand-in index cannot serve its torch: {served}"] if served else []))
        out.append(TargetRehearsal(t.id, job, problems, not why, why))
    return out


def _windows_commands_problems(target, matrix: Matrix) -> list[str]:
    """For a Windows target: the compile and link commands of its flag profile, made by the
    payload's own command builder with the job's paths, must be MSVC's (cl/link, nvcc with
    -Xcompiler, CUDA's lib\\x64, a .pyd). Skipped (no problem) where the payload has no builder."""
    if target.os.platform != "windows":
        return []
    from ci.payload.interface import build_commands
    from ci.toolchain.flags import profile_for

    bc = build_commands()

    profile = profile_for(target, matrix.stable_abi_floor)
    home = rf"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v{target.cuda}"
    torch_dir = r"C:\cache\envs\torch\Lib\site-packages\torch"
    # where vcvars64 of the runner's VS 2022 puts them (setup.py resolves them with find_msvc_tools)
    msvc = r"C:\Program Files\Microsoft Visual Studio\2022\Enterprise\VC\Tools\MSVC\14.44.35207\bin\Hostx64\x64"
    problems = []
    try:
        style = bc.style_of(profile)
        t = bc.tools(style, home, cxx=msvc + r"\cl.exe" if style == "msvc" else None,
                     linker=msvc + r"\link.exe" if style == "msvc" else None)
        cu = bc.compile_command(t, profile, "csrc/attn.cu", r"C:\b\attn.cu.obj", [home + r"\include"])
        libs = bc.library_dirs("msvc", torch_dir=torch_dir, cuda_home=home, python_prefix=r"C:\Python310")
        link = bc.link_command(t, profile, [r"C:\b\attn.cu.obj"], r"C:\b\sageattn3\_C.pyd", libs)
    except Exception as e:  # noqa: BLE001 - reported as the target's problem
        return [f"the MSVC commands cannot be made: {type(e).__name__}: {e}"]
    if t.style != "msvc" or not t.nvcc.endswith("nvcc.exe") or link[0] != msvc + r"\link.exe":
        problems.append(f"the Windows toolchain is not MSVC's (link.exe beside cl.exe, by absolute path): {t}")
    if "-c" not in cu or not any(a.startswith("-Xcompiler") for a in cu):
        problems.append(f"nvcc's host flags do not go through -Xcompiler: {cu}")
    if not any(a.lower() == rf"/libpath:{home}\lib\x64".lower() for a in link):
        problems.append(f"the link does not search CUDA's lib\\x64: {link}")
    if not any(a.startswith("/OUT:") and a.endswith(".pyd") for a in link):
        problems.append(f"the link does not produce a .pyd: {link}")
    return problems


def _pythons_first(matrix: Matrix, index_url: str, runnable: list[str]) -> None:
    """Every Python the rehearsal will use, found (or provisioned) before anything is built: a
    missing one is one error naming the targets that need it, not a failure tens of minutes in."""
    from ci.toolchain.tools import ToolchainError, find_python

    need: dict[str, list[str]] = {}
    for t in matrix.targets:
        if t.id in runnable:
            need.setdefault(t.python, []).append(t.id)
    for t, _role, _source in standin_resolutions(matrix, index_url, runnable):
        if t.id not in need.get(t.python, []):
            need.setdefault(t.python, []).append(t.id)
    for python, ids in sorted(need.items()):
        try:
            find_python(python)
        except ToolchainError as e:
            shown = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
            raise ToolchainError(f"the dry run needs Python {python} (for {shown}): {e}") from None



def dry_run(dist: Path, *, verify_pythons: list[str] | None = None, fake=None, repo: str = "sageattn3/sageattn3",
            tag: str | None = None, only: list[str] | None = None, plan_only: bool = False,
            compile_gate: bool = True, fail_targets: list[str] | None = None, log=default_log) -> DryRun:
    """The release rehearsal. plan -> every target's job resolved and checked (all of them,
    also those this machine cannot build) -> for every target whose torch the stand-in serves
    and that is not built here, its build torch and its guard's torch resolved by real pip in
    its floor Python against the stand-in, while each target that can run here goes through the
    release job's cibuildwheel hooks, as the pinned cibuildwheel resolves them, with a local
    stand-in for PyTorch's index serving PyPI's torch wheels under the target's index path -> gather ->
    publish to a local GitHub-REST server -> index + Pages branch -> summary. ``only``: the
    target ids to run (default: every one that can run here); ``plan_only``: stop after the
    checks; ``compile_gate=False`` skips compiling each torch line's unit against its torch
    headers (ci.toolchain.compile_gate, tested on its own); ``fail_targets``: target ids (any of the
    matrix) whose build job is made to fail at its cibuildwheel step without building, to
    rehearse a partial release.

    Each build job's outcome goes through ``python -m ci.release outcome`` as in the workflow,
    and the publish steps get the plan and those outcomes: when some targets fail and at least
    one verified its wheel, the others are published and the missing ones named (summary,
    release notes, index page; ``DryRun.missing``). Raises ReleaseError when a job's plan has a
    problem or no target verified its wheel (after writing the summary that names them):
    nothing is published then."""
    matrix = Matrix.load()
    dr = DryRun(dist=dist, repo=repo)
    fail_targets = list(dict.fromkeys(fail_targets or []))
    unknown_fail = [t for t in fail_targets if t not in {x.id for x in matrix.targets}]
    if unknown_fail:
        raise ReleaseInputError(f"--fail-target {' '.join(unknown_fail)}: not a target of ci/targets.toml; list them with "
                           "`nox -s build-wheels -- --list-targets`")
    unknown_only = [t for t in only or [] if t not in {x.id for x in matrix.targets}]
    if unknown_only:
        raise ReleaseInputError(f"--only {' '.join(unknown_only)}: not a target of ci/targets.toml; list them with "
                                "`nox -s build-wheels -- --list-targets`")
    dist.mkdir(parents=True, exist_ok=True)
    with pytorch_index_standin() as index_url:
        dr.jobs = rehearse_plan(matrix, index_url, log=log)
        cannot = [r for r in dr.jobs if r.id in (only or []) and not r.runs_here]
        if cannot:  # before the compile gate's minute: the ids asked for cannot run here
            raise ReleaseInputError(f"cannot rehearse {[r.id for r in cannot]} here: "
                                    + "; ".join(f"{r.id}: {r.why_not}" for r in cannot))
        gate_problem = compile_gate_problem(matrix, log=log) if compile_gate else None
        if gate_problem:
            raise ReleaseError(f"the plan has problems: {gate_problem}")
        bad = [r for r in dr.jobs if r.problems]
        runnable = [r.id for r in dr.jobs if r.runs_here]
        log(f"[plan] {len(dr.jobs)} jobs resolved and checked; {len(runnable)} can run here: {', '.join(runnable) or 'none'}")
        if bad:
            dr.summary = _jobs_table(dr)
            (dist / "summary.md").write_text(dr.summary)
            raise ReleaseError("the plan has problems: " + "; ".join(f"{r.id}: {', '.join(r.problems)}" for r in bad))
        if only:
            runnable = [i for i in runnable if i in only]
        if plan_only:
            dr.summary = _jobs_table(dr)
            (dist / "summary.md").write_text(dr.summary)
            return dr
        # every other target whose torch the stand-in serves (those that cannot build here for
        # want of their CUDA toolkit): its build torch and its guard's torch, resolved by real
        # pip in its floor Python while the targets below build (which install theirs for real)
        _pythons_first(matrix, index_url, runnable)
        for version, python in standin_needs(matrix, runnable):
            fetch_torch(version, python, matrix, log=log)
        with ThreadPoolExecutor(max_workers=1) as background:
            resolving = background.submit(resolve_served_targets, matrix, index_url, skip=runnable, log=log)
            if runnable:
                dr.planned = plan(matrix.gha_matrix(), only=runnable + fail_targets, matrix=matrix)
                shutil.rmtree(dr.artifacts, ignore_errors=True)
            _run_build_jobs(dr, matrix, index_url, fail_targets, verify_pythons, log)
            dr.resolutions = resolving.result()
        wrong = [r for r in dr.resolutions if r.problem]
        if wrong:
            dr.summary = _resolution_table(dr) + "\n\n" + _jobs_table(dr)
            (dist / "summary.md").write_text(dr.summary)
            raise ReleaseError("pip does not resolve the torch the jobs ask for: "
                               + "; ".join(f"{r.target} ({r.role}): {r.problem}" for r in wrong))
        if not runnable:
            raise ReleaseError("no target of the matrix can run here (each job's reason: `nox -s release -- --dry-run "
                               "--plan-only`); the torch specs of those the stand-in serves resolved as expected")
    build_md, failed = report(dr.planned, dr.artifacts, tag)
    parts = [build_md, "", _timing_table(dr), "", _resolution_table(dr), "", _jobs_table(dr)]
    outcomes = dist / "outcomes"
    outputs = _build_outputs(dr, outcomes, log=log)
    if len(failed) == len(dr.planned["include"]):
        dr.summary = "\n".join(parts)
        (dist / "summary.md").write_text(dr.summary)
        raise ReleaseError("dry run: every target failed, nothing published: "
                           + "; ".join(f"{m}: {dr.errors.get(m, 'no artifact')}" for m in failed))
    return _publish_locally(dr, parts, outputs, outcomes, fake=fake, repo=repo, tag=tag, log=log)


def _run_build_jobs(dr: DryRun, matrix: Matrix, index_url: str, fail_targets: list[str],
                    verify_pythons: list[str] | None, log=default_log) -> None:
    """Each planned target's release job here (``rehearse_target``), its timings or its error and
    failing step into ``dr``; a target in ``fail_targets`` fails at its cibuildwheel step unbuilt."""
    for e in dr.planned.get("include", []):
        log(f"== {e['id']}")
        if e["id"] in fail_targets:
            dr.errors[e["id"]] = "made to fail (--fail-target): its cibuildwheel step exited 1"
            dr.failed_steps[e["id"]] = "cibuildwheel"
            log(f"!! {e['id']}: {dr.errors[e['id']]}")
            continue
        try:
            # the stand-in's torch (the build's, the guard's from the directory PyPI's build of it
            # belongs in: no CPU builds of x86_64 torch on PyPI) is stocked by ci.release.cibw_local
            dr.timings[e["id"]] = rehearse_target(e["id"], dr.dist, dr.artifacts, pytorch_index=index_url,
                                                  verify_pythons=verify_pythons, log=log)
        except Exception as exc:  # noqa: BLE001 - a failed target is reported by name
            dr.errors[e["id"]] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
            dr.failed_steps[e["id"]] = "collect" if str(exc).startswith(f"{e['id']}: collect ") else "cibuildwheel"
            log(f"!! {e['id']}: {dr.errors[e['id']]}")


def _publish_locally(dr: DryRun, parts: list[str], outputs: dict[str, str], outcomes: Path, *, fake, repo: str,
                     tag: str | None, log=default_log) -> DryRun:
    """The publish job's steps on the verified targets' wheels: gather with the jobs' outputs and
    outcome files, SHA256SUMS, the GitHub Release on a local GitHub-REST server (``fake``, or one
    of its own), the index and the Pages branch; the summary with what is missing."""
    dist = dr.dist
    wheels_dir = dist / "wheels"
    shutil.rmtree(wheels_dir, ignore_errors=True)
    plan_file, outputs_file = dist / "plan.json", dist / "build-outputs.json"
    plan_file.write_text(json.dumps(dr.planned))
    outputs_file.write_text(json.dumps(outputs, indent=1, sort_keys=True))
    gathered = gather_release(dr.planned, dr.artifacts, wheels_dir, with_failed_steps(outputs, outcomes))
    dr.wheels, dr.missing = gathered.wheels, gathered.missing
    for target, why in dr.missing.items():
        log(f"[gather] not published: {target}: {why}")
    from ci.stages.record import BuildRecord, record_path

    version = BuildRecord.load(record_path(dr.wheels[0])).version.split("+")[0]
    dr.tag = tag or f"v{version}"
    check_tag(dr.tag)
    (dist / "SHA256SUMS").write_text(sha256sums(dr.wheels))
    log("[attest] skipped in a dry run (the publish job runs actions/attest-build-provenance on dist/wheels/*.whl)")

    token = "ghs_" + secrets.token_hex(18)
    own = fake is None
    if own:
        fake = GitHubStandin(token).__enter__()
    else:
        token = fake.token
    try:
        fake.add_repo(repo)
        index_dir = dist / "index"
        shutil.rmtree(index_dir, ignore_errors=True)
        # built here, not by the release's runners: their records name this machine's index
        dr.publish_log = publish_steps(wheels_dir, index_dir, fake.api_url, repo, dr.tag, token, log=log,
                                       allow_local_build=True, plan=plan_file, build_outputs=outputs_file,
                                       failed_steps=outcomes)
        rel = fake.release_by_tag(repo, dr.tag)
        state = {"tag": dr.tag, "draft": [r["draft"] for r in rel], "missing": dr.missing,
                 "assets": {n: hashlib.sha256(b).hexdigest() for r in rel
                            for n, b in sorted(fake.asset_files(repo, r["id"]).items())}}
        (dist / "release.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    finally:
        if own:
            fake.__exit__(None, None, None)
    parts += ["", f"### Published {dr.tag} (local GitHub-REST server)", "",
              *[f"- {ln}" for ln in dr.publish_log]]
    if dr.missing:
        parts += ["", f"### Missing from {dr.tag} ({len(dr.missing)} of {len(dr.planned['include'])} targets; "
                      "named in the release notes and on the index page)", "",
                  *[f"- `{t}`: {why}" for t, why in dr.missing.items()], "",
                  rerun_hint(list(dr.missing), dr.tag)]
    parts += ["", "### Install", ""]
    for w in dr.wheels:
        rec = BuildRecord.load(record_path(w))
        parts.append(f"- `{rec.target}`: `pip install --no-deps sageattn3 --index-url "
                     f"{(dist / 'index').resolve().as_uri()}/{_variant_page(rec)}`")
    dr.summary = "\n".join(parts) + "\n"
    (dist / "summary.md").write_text(dr.summary)
    return dr


def _build_outputs(dr: DryRun, outcomes: Path, log=default_log) -> dict[str, str]:
    """Every planned build job's outcome, made as build-target.yml makes it (``python -m
    ci.release outcome`` with the job's steps and its artifact folder, also writing the
    outcome-<id> file into ``outcomes``), and passed on as GitHub passes a matrix of
    reusable-workflow calls' outputs: only the legs that succeeded reach
    ``needs.build.outputs`` (a failed job's step arrives through its outcome file)."""
    outputs: dict[str, str] = {}
    shutil.rmtree(outcomes, ignore_errors=True)
    for e in dr.planned.get("include", []):
        tid = e["id"]
        failed = dr.failed_steps.get(tid)
        outcome = {"cibuildwheel": "success", "collect": "success"}
        if failed == "cibuildwheel":
            outcome = {"cibuildwheel": "failure", "collect": "skipped"}
        elif failed:
            outcome[failed] = "failure"
        steps = {sid: {"outcome": o, "conclusion": o, "outputs": {}} for sid, o in outcome.items()}
        art = dr.artifacts / f"{ARTIFACT_PREFIX}{tid}"
        art.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("r", suffix=".out") as gh_out:
            proc = subprocess.run([sys.executable, "-m", "ci.release", "outcome", "--target", tid,
                                   "--steps", json.dumps(steps), "--artifact", str(art), "--github-output", gh_out.name,
                                   "--outcome-dir", str(outcomes)],
                                  cwd=REPO, capture_output=True, text=True, env=pip_environ(sources=False))
            line = Path(gh_out.name).read_text().strip()
        key, _, value = line.partition("=")
        if proc.returncode != 0:
            log(f"!! {tid}: outcome: {proc.stderr.strip()[-500:]}")
        log(f"[outcome] {line}")
        if not failed and proc.returncode == 0:  # the leg succeeded: GitHub passes its outputs on
            outputs[key] = value
    return outputs


def _jobs_table(dr: DryRun) -> str:
    """Every target's job: where its torch and the guard's come from, its CUDA install, and
    whether the rehearsal ran it (or why not)."""
    rows = ["| target | torch (build, verify) | ABI-guard torch | CUDA | plan | here |", "|---|---|---|---|---|---|"]
    for r in dr.jobs:
        cuda = next((" ".join(argv) for name, argv in r.job.steps if name == "cuda"), "")
        cuda = "NVIDIA installer" if ".exe" in cuda else ("PyPI" if "PyPI" in cuda else "NVIDIA RHEL 8 repo")
        src = r.job.torch.index_url.rsplit("/", 1)[-1] if r.job.torch.index_url else "PyPI"
        if r.id in dr.timings:
            ran = "built + verified"
        elif r.id in dr.errors:
            ran = "FAILED"
        elif r.runs_here:
            ran = "can run here" + ("" if not dr.planned else " (not chosen)")
        else:
            ran = "planned only: " + r.why_not
        rows.append(f"| `{r.id}` | {r.job.torch.requirement} `{src}` | {r.job.foreign.requirement} `cpu` | {cuda} | "
                    f"{'ok' if not r.problems else 'PROBLEMS: ' + '; '.join(r.problems)} | {ran} |")
    return "\n".join(rows)


def _resolution_table(dr: DryRun) -> str:
    """The torch specs of every target the stand-in serves, as pip resolved them."""
    rows = ["### torch specs resolved by pip (stand-in index, each target's floor Python)", "",
            "| target | step | Python | asks for | pip resolves | time | check |", "|---|---|---|---|---|---|---|"]
    for r in dr.resolutions:
        got = f"{r.version} ({'CUDA ' + r.cuda if r.cuda else 'CPU'}) `{r.url.split('/whl/', 1)[-1]}`" if r.url else "-"
        rows.append(f"| `{r.target}` | {r.role} | {r.python} | {r.source.requirement} "
                    f"({'CUDA ' + r.source.cuda if r.source.cuda else 'CPU'}) | {got} | {r.seconds:.0f}s | "
                    f"{'ok' if not r.problem else 'PROBLEM: ' + r.problem} |")
    return "\n".join(rows)


def _variant_page(rec) -> str:
    from ci.index import index_url

    lines = rec.extra.get("torch_lines") if isinstance(getattr(rec, "extra", None), dict) else None
    line = (lines or [rec.torch_build.split("+")[0].rsplit(".", 1)[0]])[-1]
    return index_url("", rec.cuda, line).lstrip("/")


def _timing_table(dr: DryRun) -> str:
    stages = ["before-all", "build", "repair", "audit", "test", "collect"]
    rows = ["| target | " + " | ".join(stages) + " |", "|---" * (len(stages) + 1) + "|"]
    for tid, t in dr.timings.items():
        rows.append(f"| `{tid}` | " + " | ".join(f"{t[s]:.1f}s" if s in t else "-" for s in stages) + " |")
    return "\n".join(rows)


