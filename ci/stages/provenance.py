"""What ties a published wheel to the build job that verified it.

Each build job ends with ``python -m ci.release outcome`` (``if: always()``), which writes one
job output per target, ``target_<id>`` (dots as ``_``: output names allow ``[A-Za-z0-9_-]``):

- ``sha256:<hex>``: the job's steps all succeeded (cibuildwheel's test-command runs verify)
  and its artifact directory holds one wheel that passes ``ci.stages.record.check_wheel`` for this
  target; the hex is that wheel's sha256;
- ``failed:<step id>``: the first step of the job that failed (``cibuildwheel``, ``collect``…).

The outputs travel through GitHub's job outputs (``needs.build.outputs``, every matrix leg's
own key), not through the artifacts, so the publish job checks the wheels it downloaded
against hashes a replaced artifact cannot change. ``build-target.yml`` declares one output per
target of ``ci/targets.toml``; :func:`workflow_outputs` writes those lines, and a test checks
that the workflow holds exactly them.

The checks rest on GitHub keeping job outputs as the job wrote them, and on the build job's
own steps: a wheel altered inside the build job before this step would be vouched for too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from ci.runtime.errors import InputError

OUTPUT_PREFIX = "target_"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ProvenanceError(InputError, ValueError):
    """A wheel or a build outcome that cannot be vouched for; the message names the target."""


def output_key(target_id: str) -> str:
    """The job output that carries one target's outcome."""
    return OUTPUT_PREFIX + re.sub(r"[^A-Za-z0-9_-]", "_", target_id)


@dataclass(frozen=True)
class BuildOutcome:
    target: str
    sha256: str | None = None  # the verified wheel's, when the job succeeded
    failed_step: str | None = None

    @property
    def reason(self) -> str:
        if self.failed_step:
            return f"its build job failed at step `{self.failed_step}`"
        return "its build job reported no outcome (cancelled, or it did not run)"


def parse_outputs(value: str | dict | None, target_ids: list[str]) -> dict[str, BuildOutcome]:
    """The build jobs' outcomes (``toJSON(needs.build.outputs)``) for the planned targets. A
    target whose job reported nothing gets an outcome with neither sha256 nor step."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value or "{}")
        except json.JSONDecodeError as e:
            raise ProvenanceError(f"--build-outputs: not JSON ({e}); pass ${{{{ toJSON(needs.build.outputs) }}}}") from None
    if not isinstance(value, dict):
        raise ProvenanceError(f"--build-outputs: a JSON object of job outputs, not {type(value).__name__}")
    out = {}
    for tid in target_ids:
        raw = str(value.get(output_key(tid)) or "").strip()
        kind, _, rest = raw.partition(":")
        if not raw:
            out[tid] = BuildOutcome(tid)
        elif kind == "sha256" and _HEX64.match(rest):
            out[tid] = BuildOutcome(tid, sha256=rest)
        elif kind == "failed" and rest:
            out[tid] = BuildOutcome(tid, failed_step=rest)
        else:
            raise ProvenanceError(f"--build-outputs: {output_key(tid)}={raw!r}: expected sha256:<64 hex> or "
                                  "failed:<step>")
    return out


def check_verified(wheels: dict[str, tuple[str, str]], outcomes: dict[str, BuildOutcome]) -> None:
    """Every wheel (name -> (target, sha256)) is the one its target's build job verified."""
    for name, (target, sha) in sorted(wheels.items()):
        o = outcomes.get(target)
        if o is None:
            raise ProvenanceError(f"{name}: its record names target {target}, which no build job of this run "
                                  "built; publish only the run's own wheels")
        if o.sha256 is None:
            raise ProvenanceError(f"{name}: target {target}: {o.reason}, so no hash vouches for this wheel")
        if o.sha256 != sha:
            raise ProvenanceError(f"{name}: sha256 {sha}, but its build job verified {o.sha256}: this is not the "
                                  "wheel that was built and verified; re-run the target's build job")


def first_failed_step(steps: dict) -> str | None:
    """The id of the first step whose outcome is not success (``toJSON(steps)`` keeps the
    order the steps ran in)."""
    for sid, st in steps.items():
        if isinstance(st, dict) and st.get("outcome") in ("failure", "cancelled"):
            return sid
    return None


def outcome_value(target_id: str, steps_json: str, artifact: Path) -> str:
    """This build job's output value: ``failed:<step>``, or ``sha256:<hex>`` of the one wheel
    in ``artifact`` after the full check of its record (ProvenanceError when it fails)."""
    from ci.stages.record import RecordError, load_records

    try:
        steps = json.loads(steps_json or "{}")
    except json.JSONDecodeError as e:
        raise ProvenanceError(f"--steps: not JSON ({e}); pass ${{{{ toJSON(steps) }}}}") from None
    failed = first_failed_step(steps if isinstance(steps, dict) else {})
    if failed:
        return f"failed:{failed}"
    try:
        records = load_records(artifact)
    except RecordError as e:
        raise ProvenanceError(f"{target_id}: {e}") from None
    if len(records) != 1 or records[0].target != target_id:
        raise ProvenanceError(f"{target_id}: {artifact} holds {[r.wheel for r in records]}, expected one wheel "
                              f"of this target")
    return f"sha256:{records[0].sha256}"


def workflow_outputs(target_ids: list[str]) -> tuple[list[str], list[str]]:
    """The lines build-target.yml declares: (``on.workflow_call.outputs`` entries, the job's
    ``outputs`` entries), one per target."""
    call, job = [], []
    for tid in sorted(target_ids):
        key = output_key(tid)
        call += [f"      {key}:", f"        value: ${{{{ jobs.build.outputs.{key} }}}}"]
        job.append(f"      {key}: ${{{{ steps.outcome.outputs.{key} }}}}")
    return call, job


def built_outside_pipeline(index_url: str) -> bool:
    """Does a build record's ``index_url`` say the wheel was built outside the release
    pipeline? A pipeline build names the published index (http(s)); a local build names the
    index it writes on disk (``file:///…/dist/index/``)."""
    from urllib.parse import urlsplit

    return urlsplit(index_url or "").scheme not in ("http", "https")


def check_for_release(records, build_outputs: str | dict | None, plan: dict | None,
                      allow_local_build: bool) -> dict[str, str]:
    """What ``publish github`` refuses before any request, beyond the wheels' own checks: wheels
    that no build job's outputs vouch for (no ``build_outputs``) and a wheel built outside the
    release pipeline, both unless ``allow_local_build``, and, given the build jobs' outputs, a
    wheel that is not the one its job verified. Returns the planned
    targets without a wheel here: target id -> why (for the release notes)."""
    if build_outputs is None and not allow_local_build:
        raise ProvenanceError("no --build-outputs: nothing ties these wheels to the build jobs that verified them "
                              "(a record's index URL can be written anywhere); pass the release run's build outputs "
                              "with --plan and --build-outputs (release.yml does), or --allow-local-build to publish "
                              "wheels that no build job vouches for")
    for rec in records:
        if built_outside_pipeline(rec.index_url) and not allow_local_build:
            raise ProvenanceError(f"{rec.wheel}: index_url {rec.index_url!r}: its build record says it was built "
                                  "outside the release pipeline (a local index); a GitHub Release takes the release "
                                  "pipeline's wheels: publish those, or pass --allow-local-build to publish this one")
    if build_outputs is not None:
        ids = [e["id"] for e in (plan or {}).get("include", [])] or sorted({r.target for r in records})
        check_verified({r.wheel: (r.target, r.sha256) for r in records}, parse_outputs(build_outputs, ids))
    return missing_targets(records, build_outputs, plan)


def missing_targets(records, build_outputs: str | dict | None, plan: dict | None) -> dict[str, str]:
    """The planned targets without a wheel among ``records``: target id -> why (its build job's
    failing step, from the jobs' outputs). The one source of what a partial release lacks: the
    release notes (ci.release.publish.notes) and the index page (ci.index) both name these."""
    ids = [e["id"] for e in (plan or {}).get("include", [])] or sorted({r.target for r in records})
    outcomes = parse_outputs(build_outputs, ids) if build_outputs is not None else {}
    have = {r.target for r in records}
    return {t: (outcomes[t].reason if t in outcomes else "no wheel of it was gathered") for t in ids if t not in have}


# The --failed-steps option of gather, publish and index (the three read the same folder).
FAILED_STEPS_HELP = ("the folder of the build jobs' outcome files (the outcome-* artifacts): a failed job's step, "
                     "which GitHub does not pass on in the job outputs of a failed matrix leg; never a hash")


def with_failed_steps(outputs: dict | None, folder: str | Path | None) -> dict | None:
    """The build jobs' outputs with each failed job's step added from its outcome file.

    GitHub passes a matrix of reusable-workflow calls' outputs on from the legs that succeeded
    only, so a failed leg's ``failed:<step>`` never reaches ``needs.build.outputs``. Each leg
    therefore also uploads its outcome as a file (``outcome-<id>``: ``<output key>`` holding
    the value; build-target.yml, ``python -m ci.release outcome --outcome-dir``). Those files
    come from artifacts, which a later job can replace, so only ``failed:<step>`` is read from
    them, for targets the job outputs say nothing about: a hash in a file never vouches for a
    wheel. ``folder`` None or absent: ``outputs`` unchanged."""
    if outputs is None or folder is None or not Path(folder).is_dir():
        return outputs
    merged = dict(outputs)
    for f in sorted(Path(folder).rglob(f"{OUTPUT_PREFIX}*")):
        value = f.read_text(encoding="utf-8", errors="replace").strip()
        if f.is_file() and not str(merged.get(f.name) or "").strip() and re.fullmatch(r"failed:[A-Za-z0-9_-]+", value):
            merged[f.name] = value
    return merged


def json_argument(value: str | None, option: str, error: type[Exception]):
    """A command-line JSON document given inline or as @file (None stays None); ``error`` (the
    command's input error) names the option when it is neither."""
    from pathlib import Path

    if value is None:
        return None
    try:
        text = Path(value[1:]).read_text(encoding="utf-8") if value.startswith("@") else value
        return json.loads(text or "{}")
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{option}: not a JSON document or @file ({e})") from None
