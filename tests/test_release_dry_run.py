"""End to end: the release rehearsal (`nox -s release -- --dry-run`) for a target this machine
can build: plan (all jobs checked) -> the release job run by the pinned cibuildwheel in the
stand-in manylinux container, with the stand-in for PyTorch's index serving the target's torch
(build, verify in the target's oldest Python, ABI guard), while the other targets whose torch the stand-in serves have
their build and guard torch resolved by real pip in their floor Python -> artifact -> gather ->
publish to a local server speaking GitHub's REST contract -> index on the Pages branch ->
summary. One more target of the matrix is made to fail at its cibuildwheel step: the release is
published without it and names it (summary, notes, index page). Then a re-run publishes nothing new. It builds a real wheel (minutes), so it runs where the stand-in's torch wheels are already
in the factory cache (after one `nox -s release -- --dry-run`), or with SAGEATTN3_REHEARSAL=1."""

import hashlib
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from ci.release.rehearsal import dry_run, rehearse_plan
from ci.release.standin import standin_dir, standin_needs, standin_serves, standin_wheels
from ci.release.steps import publish_steps
from ci.toolchain.targets import Matrix
from ci.release.github_standin import GitHubStandin
from ci.stages.provenance import output_key

MATRIX = Matrix.load()
RUNNABLE = [r for r in rehearse_plan(MATRIX) if r.runs_here]
TARGET = RUNNABLE[0] if RUNNABLE else None


def _cached() -> bool:
    """The stand-in holds every torch wheel the rehearsal needs: the local target's build and
    guard torch, and those of every other target it resolves."""
    if TARGET is None:
        return False
    tag = lambda py: "cp" + py.replace(".", "")  # noqa: E731
    return all(list((standin_wheels() / standin_dir(v, MATRIX)).glob(f"torch-{v}-{tag(py)}-*.whl"))
               for v, py in standin_needs(MATRIX, [TARGET.id]))


pytestmark = [
    pytest.mark.skipif(TARGET is None, reason="no target of the matrix can run here"),
    pytest.mark.skipif(not shutil.which("nvcc"), reason="needs a CUDA 13.0 toolkit"),
    pytest.mark.skipif(not (_cached() or os.environ.get("SAGEATTN3_REHEARSAL") == "1"),
                       reason="the rehearsal's torch wheels are not cached (run `nox -s release -- --dry-run` once, "
                              "or set SAGEATTN3_REHEARSAL=1)"),
]
REPO_NAME = "octo/sageattn3"
LOCAL = [TARGET.id] if TARGET else []
# the job the trace ranks likeliest to fail: a Windows one (never built on a real runner)
FAILING = next(t.id for t in MATRIX.targets if t.os.platform == "windows")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    token = "ghs_" + secrets.token_hex(18)
    dist = tmp_path_factory.mktemp("release") / "dist"
    logs: list[str] = []
    with GitHubStandin(token) as fake:
        dr = dry_run(dist, fake=fake, repo=REPO_NAME, only=LOCAL, compile_gate=False, fail_targets=[FAILING],
                     log=lambda m: logs.append(str(m)))
        yield dr, fake, token, logs


def test_every_local_target_went_through_each_stage(released):
    dr, _, _, _ = released
    assert sorted(e["id"] for e in dr.planned["include"]) == sorted(LOCAL + [FAILING])
    assert set(dr.errors) == {FAILING}
    for tid in LOCAL:
        # cibuildwheel's own steps, as its log times them, then build-target.yml's collect
        assert set(dr.timings[tid]) == {"before-all", "build", "repair", "audit", "test", "collect"}
        art = dr.artifacts / f"wheel-{tid}"
        wheels = list(art.glob("*.whl"))
        assert len(wheels) == 1 and Path(str(wheels[0]) + ".json").exists()
        rec = json.loads(Path(str(wheels[0]) + ".json").read_text())
        assert rec["target"] == tid and "manylinux" in wheels[0].name
        assert rec["requires_python"] == f">={TARGET.job.target.python}"


def test_every_other_served_target_resolved_its_torch_specs_in_its_floor_python(released):
    """The targets whose torch the stand-in serves but that cannot build here (their CUDA 12.x
    toolkit): pip, run by the target's floor Python, resolves the job's build torch and guard
    torch from the stand-in's directory of the right CUDA."""
    dr, _, _, logs = released
    others = [t for t in MATRIX.targets if not standin_serves(t, MATRIX) and t.id not in LOCAL]
    assert others and {(r.target, r.role) for r in dr.resolutions} == {(t.id, role) for t in others
                                                                        for role in ("build", "guard")}
    jobs = {r.id: r.job for r in dr.jobs}
    for r in dr.resolutions:
        t = MATRIX.target(r.target)
        want = jobs[t.id].torch if r.role == "build" else jobs[t.id].foreign
        assert r.problem is None, r.describe()
        assert r.python == t.python and r.version.split("+")[0] == want.version
        ran = subprocess.run([r.interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert ran == t.python, (r.interpreter, ran)
        if r.role == "build":
            assert r.cuda == t.cuda and f"/whl/{t.variant.cuda_tag}/torch/" in r.url and "127.0.0.1" in r.url
        else:  # a CUDA build of a line outside the wheel's (PyPI has no CPU builds for x86_64)
            assert r.cuda == f"{int(standin_dir(r.version, MATRIX)[2:-1])}.{standin_dir(r.version, MATRIX)[-1]}"
            assert not t.variant.serves(r.version, r.cuda)
    assert any(r.python == "3.9" for r in dr.resolutions)  # the cp39 floor ran
    summary = (dr.dist / "summary.md").read_text()
    assert "torch specs resolved by pip" in summary and summary.count("` | build | ") == len(others)


def test_verify_used_the_targets_torch_from_the_standin_in_its_oldest_python(released):
    dr, _, _, logs = released
    t = TARGET.job.target
    src = [ln for ln in logs if ln.startswith(f"[verify] py{t.python}: torch {t.build_torch}+{t.variant.cuda_tag}")]
    assert src and f"/whl/{t.variant.cuda_tag}" in src[0] and "127.0.0.1" in src[0]
    guard = [ln for ln in logs if ln.startswith("[verify] ABI guard with torch ")]
    assert guard and TARGET.job.foreign.version in guard[0] and "TorchMismatchError" in guard[0]
    summary = (dr.dist / "summary.md").read_text()
    assert f"| `{t.id}` |" in summary and "built + verified" in summary
    # every job but those this machine can run (the rehearsed one, and any other that could) and
    # the one made to fail
    assert summary.count("planned only: ") == sum(1 for r in dr.jobs if not r.runs_here and r.id != FAILING)
    assert f"| `{FAILING}` |" in summary and summary.count("| FAILED |") == 1


def test_the_release_is_published_complete_with_checksums(released):
    dr, fake, _, _ = released
    rels = fake.release_by_tag(REPO_NAME, dr.tag)
    assert len(rels) == 1 and rels[0]["draft"] is False
    files = fake.asset_files(REPO_NAME, rels[0]["id"])
    local = {w.name for w in dr.wheels} | {w.name + ".json" for w in dr.wheels}
    assert set(files) == local | {"SHA256SUMS"}
    # what RELEASING.md tells users: every line of SHA256SUMS matches the downloaded file
    sums = dict(reversed(line.split(None, 1)) for line in files["SHA256SUMS"].decode().splitlines())
    for name in local:
        assert sums[name.strip()] == hashlib.sha256(files[name]).hexdigest()
    for w in dr.wheels:
        assert files[w.name] == w.read_bytes()
    state = json.loads((dr.dist / "release.json").read_text())
    assert state["draft"] == [False] and set(state["assets"]) == set(files)


def test_the_index_is_on_the_pages_branch(released):
    dr, fake, _, _ = released
    site = fake.branch_files(REPO_NAME, "gh-pages")
    assert "index.json" in site and "index.html" in site
    for w in dr.wheels:
        assert f"files/{w.name}" in site
        assert site[f"files/{w.name}"] == w.read_bytes()
    pages = [p for p in site if p.endswith("sageattn3/index.html")]
    assert pages and all(any(w.name.replace("+", "%2B") in site[p].decode() or w.name in site[p].decode()
                             for w in dr.wheels) for p in pages)


def test_summary_names_targets_release_and_install_command(released):
    dr, _, token, logs = released
    text = (dr.dist / "summary.md").read_text()
    for tid in LOCAL:
        assert f"`{tid}` | ok" in text
    assert f"Published {dr.tag}" in text and "pip install --no-deps sageattn3 --index-url" in text
    assert (dr.dist / "SHA256SUMS").read_text().count("\n") == len(dr.wheels)
    assert token not in text and all(token not in line for line in logs)


def test_a_rerun_of_the_publish_steps_uploads_nothing(released):
    dr, fake, token, _ = released
    uploads = fake.uploads()
    site = fake.branch_files(REPO_NAME, "gh-pages")
    lines = publish_steps(dr.dist / "wheels", dr.dist / "index", fake.api_url, REPO_NAME, dr.tag, token,
                          log=lambda m: None, allow_local_build=True)
    assert fake.uploads() == uploads
    assert "uploaded 0" in lines[0]
    assert fake.branch_files(REPO_NAME, "gh-pages") == site


def test_the_failing_target_is_left_out_and_named_everywhere(released):
    """A partial release: the verified targets published, the failed one named with its step
    in the summary, the release notes and the index page; its job's output says where it failed."""
    dr, fake, _, logs = released
    why = "its build job failed at step `cibuildwheel`"
    assert dr.missing == {FAILING: why}
    outputs = json.loads((dr.dist / "build-outputs.json").read_text())
    # as GitHub passes a matrix of workflow calls' outputs on: the failed leg's is not there; its
    # step arrives through its outcome file (the outcome-<id> artifact)
    assert output_key(FAILING) not in outputs
    assert (dr.dist / "outcomes" / output_key(FAILING)).read_text().strip() == "failed:cibuildwheel"
    for tid in LOCAL:
        rec = json.loads(next((dr.artifacts / f"wheel-{tid}").glob("*.whl.json")).read_text())
        assert outputs[output_key(tid)] == f"sha256:{rec['sha256']}"
    assert {json.loads(Path(str(w) + ".json").read_text())["target"] for w in dr.wheels} == set(LOCAL)
    assert f"[outcome] {output_key(FAILING)}=failed:cibuildwheel" in logs
    summary = (dr.dist / "summary.md").read_text()
    assert f"### Missing from {dr.tag}" in summary and f"- `{FAILING}`: {why}" in summary
    assert f"`{FAILING}` | FAILED" in summary and "gh run rerun" in summary
    body = fake.release_by_tag(REPO_NAME, dr.tag)[0]["body"]
    assert f"`{FAILING}`: {why}" in body
    root = fake.branch_files(REPO_NAME, "gh-pages")["index.html"].decode()
    assert FAILING in root and "cibuildwheel" in root
    assert json.loads((dr.dist / "release.json").read_text())["missing"] == {FAILING: why}

