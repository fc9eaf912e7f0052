"""The release pipeline's own steps: the build jobs' plan, the tag check, the report and the
gather of the build jobs' artifacts, and the publish job's steps after gather.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ci.release import REPO, ReleaseError, ReleaseInputError
from ci.runtime.log import default_log
from ci.toolchain.targets import Matrix
from ci.runtime.env import child_environ

ARTIFACT_PREFIX = "wheel-"



# -- plan ------------------------------------------------------------------------------------

def plan(matrix_json: dict, only: list[str] | None = None, matrix: Matrix | None = None) -> dict:
    """The build jobs' matrix: ``matrix_json`` (from ``nox -s matrix``) must cover every target
    of the targets file and nothing else, each entry agreeing with its target; ``only``
    narrows it to chosen ids (re-running some targets)."""
    matrix = matrix or Matrix.load()
    expected = {e["id"]: e for e in matrix.gha_matrix()["include"]}
    entries = matrix_json.get("include") if isinstance(matrix_json, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ReleaseInputError("the matrix JSON has no 'include' list of build units (an object "
                                "{\"include\": [{\"id\": ...}, ...]}, as `nox -s matrix` prints)")
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


# -- the tag ------------------------------------------------------------------------------------

VERSION_FILE = REPO / "sageattn3" / "sageattn3" / "_version.py"


def package_version(path: Path = VERSION_FILE) -> str:
    """The payload's version (``__version__`` in sageattn3/_version.py), PEP 440 normalised."""
    from packaging.version import InvalidVersion, Version

    m = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", path.read_text(), flags=re.M)
    if not m:
        raise ReleaseError(f"{path.name}: no __version__ = \"X.Y.Z\" line")
    try:
        return str(Version(m.group(1)))
    except InvalidVersion:
        raise ReleaseError(f"{path.name}: __version__ {m.group(1)!r} is not a PEP 440 version") from None


def check_tag(tag: str, path: Path = VERSION_FILE) -> str:
    """The release tag must be ``v`` + the payload's normalised version (``v0.2.0`` for
    ``0.2.0``; ``v1.0.0rc1`` for ``1.0.0-rc.1``); returns the version."""
    version = package_version(path)
    if tag != f"v{version}":
        raise ReleaseInputError(f"tag {tag!r} does not match the package version {version} "
                           f"(sageattn3/sageattn3/_version.py): tag v{version}, or change __version__")
    return version


# -- artifacts: report and gather -------------------------------------------------------------

@dataclass
class ArtifactState:
    target: str
    wheel: str | None = None
    sha256: str | None = None
    problem: str | None = None
    refused: bool = False  # an artifact is there but may not be published (not merely missing)


def inspect_artifacts(planned: dict, artifacts: Path) -> list[ArtifactState]:
    """One state per planned target: its artifact dir ``wheel-<id>`` with exactly one wheel and
    a build record that names the target and the wheel's sha256, the wheel passing the shared
    check (``ci.stages.record.check_wheel``: hygiene, file name, METADATA, RECORD, the inner record)."""
    from ci.stages.record import RecordError, check_wheel, load_record_beside, record_path, sha256_of

    out = []
    for e in planned["include"]:
        st = ArtifactState(e["id"])
        d = artifacts / f"{ARTIFACT_PREFIX}{e['id']}"
        wheels = sorted(d.glob("*.whl")) if d.is_dir() else []
        if not wheels:
            st.problem = "no artifact (its build job failed or did not run)"
            out.append(st)
            continue
        st.refused = True
        if len(wheels) > 1:
            st.problem = f"{len(wheels)} wheels in its artifact: {[w.name for w in wheels]}"
        elif not record_path(wheels[0]).exists():
            st.problem = f"{wheels[0].name} has no build record beside it"
        else:
            try:
                rec = load_record_beside(wheels[0])
                sha = sha256_of(wheels[0])
                if rec.target != e["id"]:
                    st.problem = f"{wheels[0].name}: its record names target {rec.target}"
                elif rec.wheel != wheels[0].name or rec.sha256 != sha:
                    st.problem = f"{wheels[0].name}: its record says {rec.wheel} sha256 {rec.sha256}, the file has {sha}"
                elif rec.variant != e["variant"]:
                    st.problem = f"{wheels[0].name}: variant {rec.variant}, the plan says {e['variant']}"
                else:
                    check_wheel(wheels[0], rec, sha256=sha)
                    st.wheel, st.sha256, st.refused = wheels[0].name, sha, False
            except RecordError as err:
                st.problem = str(err)
        out.append(st)
    return out


def rerun_hint(missing: list[str], tag: str | None = None) -> str:
    ref = tag or "<tag>"
    return ("complete the release with the run's \"Re-run failed jobs\" (`gh run rerun RUN_ID --failed`): the same "
            "run, so every other target's artifact and build outcome are still there, and publish adds these. "
            f"To check a fix first: `gh workflow run release.yml --ref {ref} -f targets={','.join(missing)}` "
            "builds only these and publishes nothing")


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
        tail = (f"\n\n**Not in this release yet**: {len(missing)} target(s) failed: "
                f"{', '.join(f'`{m}`' for m in missing)}; the publish job publishes the others (when their build "
                f"jobs verified them) and names these.\n\n{rerun_hint(missing, tag)}\n")
    return head + "\n".join(rows) + tail, missing


@dataclass
class Gathered:
    wheels: list[Path]
    missing: dict[str, str]  # target id -> why it is not published (its failing step)


def gather(planned: dict, artifacts: Path, out: Path, build_outputs: str | dict | None = None) -> list[Path]:
    """Every planned target's wheel + record into ``out``; see :func:`gather_release`. Returns
    the wheels copied."""
    return gather_release(planned, artifacts, out, build_outputs).wheels


def gather_release(planned: dict, artifacts: Path, out: Path, build_outputs: str | dict | None = None) -> Gathered:
    """The publish job's gate: the planned targets' wheels + records into ``out``.

    Refused with ReleaseInputError (nothing copied): an artifact that is unsafe or
    inconsistent, and, given ``build_outputs`` (the build jobs' outputs, ci.stages.provenance),
    a wheel whose sha256 is not the one its build job verified, or two wheels that shadow each
    other. Without ``build_outputs``, all or nothing: any missing target stops it. With them, a
    partial release: the targets whose build job verified their wheel are gathered, the others
    are returned by name with the step that failed (at least one must be there)."""
    from ci.stages.record import record_path
    from ci.stages.provenance import ProvenanceError, check_verified, parse_outputs
    from ci.stages.wheel_hygiene import UnsafeWheel, check_distinct

    units = planned.get("include") if isinstance(planned, dict) else None
    if not isinstance(units, list) or not all(isinstance(e, dict) and isinstance(e.get("id"), str) for e in units):
        raise ReleaseInputError("the plan has no 'include' list of build units with an 'id' each (pass the "
                                "plan step's output, {\"include\": [{\"id\": ...}, ...]})")
    ids = [e["id"] for e in units]
    try:
        outcomes = parse_outputs(build_outputs, ids) if build_outputs is not None else None
    except ProvenanceError as e:
        raise ReleaseInputError(str(e)) from None
    states = inspect_artifacts(planned, artifacts)
    refused = [s for s in states if s.refused and (outcomes is None or outcomes[s.target].sha256)]
    if refused:
        raise ReleaseInputError("not publishing: " + "; ".join(f"{s.target}: {s.problem}" for s in refused)
                                + ". Nothing was copied: re-run these targets' build jobs")
    missing: dict[str, str] = {}
    if outcomes is None:
        bad = [s for s in states if s.problem]
        if bad:
            raise ReleaseError("not publishing: " + "; ".join(f"{s.target}: {s.problem}" for s in bad)
                               + ". " + rerun_hint([s.target for s in bad]))
        good = states
    else:
        good = []
        for s in states:
            o = outcomes[s.target]
            if o.sha256 is None:
                missing[s.target] = o.reason + (" (its artifact is ignored: nothing vouches for it)" if s.wheel else "")
            elif s.wheel is None:
                missing[s.target] = "its build job verified a wheel, but its artifact is missing (expired or deleted)"
            else:
                good.append(s)
        try:
            check_verified({s.wheel: (s.target, s.sha256) for s in good}, outcomes)
        except ProvenanceError as e:
            raise ReleaseInputError(f"not publishing: {e}. Nothing was copied") from None
        if not good:
            raise ReleaseError("not publishing: no build job verified its wheel: "
                               + "; ".join(f"{t}: {why}" for t, why in missing.items()))
    try:
        check_distinct([s.wheel for s in good], "(another planned target)")
    except UnsafeWheel as e:
        raise ReleaseInputError(f"not publishing: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    keep = {s.wheel for s in good}
    stray = [p.name for p in out.glob("*.whl") if p.name not in keep]
    if stray:
        raise ReleaseError(f"{out} holds wheels of no planned target: {stray}")
    copied = []
    for s in good:
        src = artifacts / f"{ARTIFACT_PREFIX}{s.target}" / s.wheel
        shutil.copy2(src, out / s.wheel)
        shutil.copy2(record_path(src), record_path(out / s.wheel))
        copied.append(out / s.wheel)
    return Gathered(copied, missing)


def sha256sums(wheels: list[Path]) -> str:
    """``sha256sum -c`` lines for the wheels (what the release's SHA256SUMS vouches for)."""
    lines = []
    for w in sorted(wheels, key=lambda p: p.name):
        lines.append(f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}")
    return "\n".join(lines) + "\n"


def publish_steps(wheels: Path, index_dir: Path, api_url: str, repo: str, tag: str, token: str,
                  log=default_log, *, allow_local_build: bool = False, plan: Path | None = None,
                  build_outputs: Path | None = None, failed_steps: Path | None = None) -> list[str]:
    """The publish job's steps after gather, as the workflow runs them (nox -s publish / index /
    release -- pages run these same commands). ``allow_local_build``: the wheels were built
    here (their records name a local index), which a GitHub Release refuses unless told.
    ``plan`` and ``build_outputs``: JSON files of the build jobs' matrix and outputs, passed
    as the workflow passes them (every wheel checked against its job's hash; the missing
    targets named in the notes and on the index page); ``failed_steps``: the folder of the jobs'
    outcome files (the failed jobs' steps)."""
    env = child_environ(GITHUB_TOKEN=token, SAGEATTN3_WRITE_INTERVAL="0")
    owner, name = repo.split("/")
    base_url = f"https://{owner}.github.io/{name}/"
    outcomes = ["--plan", f"@{plan}", "--build-outputs", f"@{build_outputs}"] if plan and build_outputs else []
    outcomes += ["--failed-steps", str(failed_steps)] if outcomes and failed_steps else []
    cmds = [
        [sys.executable, "-m", "ci.release.publish", "github", "--tag", tag, "--repo", repo, "--api-url", api_url,
         "--wheels", str(wheels), *outcomes, *(["--allow-local-build"] if allow_local_build else [])],
        [sys.executable, "-m", "ci.index", "build", "--wheels", str(wheels), "--out", str(index_dir),
         "--base-url", base_url, *outcomes],
        [sys.executable, "-m", "ci.release.publish", "pages", "--repo", repo, "--index", str(index_dir), "--tag", tag,
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


def compile_gate_problem(matrix: Matrix, log=default_log) -> str | None:
    """Why the matrix cannot be released: a torch line whose torch-facing unit does not compile
    against that torch's real headers (ci.toolchain.compile_gate); None when every line compiles."""
    from ci.toolchain import compile_gate

    return compile_gate.failures_message(matrix, compile_gate.run_gate(matrix, log=log))

