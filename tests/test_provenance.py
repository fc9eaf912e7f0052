"""Provenance from the build job to the upload (ci/stages/provenance.py), and partial releases:

- a build job's outcome step (``python -m ci.release outcome``, run for real) reports the
  verified wheel's sha256 or the step that failed, as the job output the publish job reads;
- a re-signed wheel (content changed, its RECORD and ``.json`` recomputed, so every check of
  the wheel itself passes) is refused by gather and by ``publish github`` before any request;
- a wheel whose record names a local index (built outside the release pipeline) is refused for
  a GitHub Release unless ``--allow-local-build``;
- a run where one target's build failed publishes the others, and the release notes name the
  missing target with its failing step; after that job is re-run, publishing again adds its
  wheel and the notes drop it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci.release.publish.__main__ import main as publish_main
from ci.release.publish.notes import BEGIN
from ci.stages.record import BuildRecord, load_records, record_path
from ci.stages.provenance import output_key
from conftest_publish import REPO, rewrite_wheel, sage_wheel
from ci.release.github_standin import GitHubStandin

pytestmark = pytest.mark.timeout(180)

TOKEN = "ghp_" + "p" * 36
FULL = "octo/sageattn3"
TARGETS = {"t-cu130": "cu130.torch2.10.stable", "t-cu128": "cu128.torch2.10.stable", "t-cu128-28": "cu128.torch2.8"}
PLAN = {"include": [{"id": t, "variant": v} for t, v in TARGETS.items()]}
OK_STEPS = json.dumps({"env": {"outcome": "success"}, "cibuildwheel": {"outcome": "success"},
                       "collect": {"outcome": "success"}})


def _build_job(artifacts: Path, target: str, *, fail_at: str | None = None, **kw) -> tuple[Path | None, str]:
    """One build job: its artifact ``wheel-<target>`` (none when it failed) and the output line
    its outcome step writes (the real command)."""
    art = artifacts / f"wheel-{target}"
    wheel = None
    steps = json.loads(OK_STEPS)
    if fail_at:
        steps[fail_at] = {"outcome": "failure"}
        art.mkdir(parents=True)
    else:
        wheel, _ = sage_wheel(art, TARGETS[target], "0.1.0", target=target, payload=os.urandom(512), **kw)
    (artifacts / f"{target}.out").unlink(missing_ok=True)  # $GITHUB_OUTPUT: a fresh file per job
    p = subprocess.run([sys.executable, "-m", "ci.release", "outcome", "--target", target, "--steps", json.dumps(steps),
                        "--artifact", str(art), "--github-output", str(artifacts / f"{target}.out")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return wheel, (artifacts / f"{target}.out").read_text().strip()


def _outputs(lines: list[str]) -> str:
    """toJSON(needs.build.outputs) as GitHub gives it to the publish job."""
    return json.dumps(dict(line.split("=", 1) for line in lines))


def _gather(artifacts: Path, out: Path, outputs: str, plan: dict = PLAN) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ci.release", "gather", "--plan", json.dumps(plan), "--artifacts",
                           str(artifacts), "--out", str(out), "--build-outputs", outputs], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_outcome_step_reports_the_verified_sha256_or_the_failing_step(tmp_path):
    wheel, line = _build_job(tmp_path, "t-cu130")
    assert line == f"{output_key('t-cu130')}=sha256:{BuildRecord.load(record_path(wheel)).sha256}"
    assert output_key("t-cu130") == "target_t-cu130" and output_key("a-torch2.10") == "target_a-torch2_10"
    _, line = _build_job(tmp_path, "t-cu128", fail_at="cibuildwheel")
    assert line == "target_t-cu128=failed:cibuildwheel"
    # an artifact the check refuses: the job fails (exit 2) and says so in its output
    rewrite_wheel(wheel, {"../evil.pth": b"x"})
    p = subprocess.run([sys.executable, "-m", "ci.release", "outcome", "--target", "t-cu130", "--steps", OK_STEPS,
                        "--artifact", str(wheel.parent)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout.strip() == "target_t-cu130=failed:outcome" and "../evil.pth" in p.stderr


def _resign(wheel: Path) -> None:
    """Other content, with RECORD and the beside-record recomputed: consistent in itself."""
    rewrite_wheel(wheel, {"sageattn3/__init__.py": b"import os; os.system('echo owned')\n"})
    record_path(wheel).write_text(BuildRecord.load(record_path(wheel)).with_wheel(wheel).to_json())


def test_a_re_signed_wheel_is_refused_by_gather_and_publish_before_any_request(tmp_path, capsys, monkeypatch):
    arts = tmp_path / "artifacts"
    built = [_build_job(arts, t) for t in TARGETS]
    outputs = _outputs([line for _, line in built])
    p = _gather(arts, tmp_path / "control", outputs)
    assert p.returncode == 0 and "gathered 3 wheel(s)" in p.stdout, p.stderr  # untouched: through
    victim = built[0][0]
    _resign(victim)
    p = _gather(arts, tmp_path / "wheels", outputs)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "but its build job verified" in p.stderr and victim.name in p.stderr and "Nothing was copied" in p.stderr
    assert not (tmp_path / "wheels").exists()
    # publish, given the same outputs (a re-signed wheel put into its wheels directory)
    wheels = tmp_path / "control"
    shutil.copy2(victim, wheels / victim.name)
    shutil.copy2(record_path(victim), record_path(wheels / victim.name))
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    with GitHubStandin(TOKEN) as gh:
        gh.add_repo(FULL)
        for extra in ([], ["--dry-run"]):
            rc = publish_main(["github", "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels), "--api-url",
                               gh.api_url, "--write-interval", "0", "--build-outputs", outputs, "--plan", json.dumps(PLAN),
                               *extra])
            err = capsys.readouterr().err
            assert rc == 2 and "this is not the wheel that was built and verified" in err, err
        assert gh.count() == 0


def test_a_wheel_built_outside_the_release_pipeline_needs_an_explicit_flag(tmp_path, capsys, monkeypatch):
    wheels = tmp_path / "wheels"
    sage_wheel(wheels, "cu130.torch2.10.stable", "0.1.0", index_url=(tmp_path / "dist" / "index").as_uri() + "/")
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    with GitHubStandin(TOKEN) as gh:
        gh.add_repo(FULL)
        args = ["github", "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(wheels), "--api-url", gh.api_url,
                "--write-interval", "0"]
        # without the build jobs' outputs nothing vouches for any wheel (an index URL is just text)
        rc = publish_main(args)
        err = capsys.readouterr().err
        assert rc == 2 and "no --build-outputs" in err and "--allow-local-build" in err, err
        # vouched for by a build job's hash, but its record names a local index
        (rec,) = load_records(wheels)
        vouched = ["--plan", json.dumps({"include": [{"id": rec.target, "variant": rec.variant}]}),
                   "--build-outputs", json.dumps({output_key(rec.target): f"sha256:{rec.sha256}"})]
        rc = publish_main([*args, *vouched])
        err = capsys.readouterr().err
        assert rc == 2 and "built outside the release pipeline" in err and "--allow-local-build" in err, err
        assert gh.count() == 0
        assert publish_main([*args, *vouched, "--allow-local-build"]) == 0
        assert gh.release_by_tag(FULL, "v0.1.0")[0]["draft"] is False


def test_one_failed_target_publishes_the_others_and_the_notes_name_it_until_it_is_rebuilt(tmp_path, capsys, monkeypatch):
    arts = tmp_path / "artifacts"
    lines = [_build_job(arts, "t-cu130")[1], _build_job(arts, "t-cu128")[1],
             _build_job(arts, "t-cu128-28", fail_at="cibuildwheel")[1]]
    outputs = _outputs(lines)
    p = _gather(arts, tmp_path / "wheels", outputs)
    assert p.returncode == 0, p.stderr
    assert "gathered 2 wheel(s)" in p.stdout
    assert "not published: t-cu128-28: its build job failed at step `cibuildwheel`" in p.stdout
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    args = ["github", "--tag", "v0.1.0", "--repo", FULL, "--wheels", str(tmp_path / "wheels"), "--write-interval", "0",
            "--plan", json.dumps(PLAN), "--build-outputs", outputs]
    with GitHubStandin(TOKEN) as gh:
        gh.add_repo(FULL)
        assert publish_main([*args, "--api-url", gh.api_url, "--notes", "sageattn3 0.1.0"]) == 0
        (rel,) = gh.release_by_tag(FULL, "v0.1.0")
        assert rel["draft"] is False and sum(n.endswith(".whl") for n in gh.asset_files(FULL, rel["id"])) == 2
        assert rel["body"].startswith("sageattn3 0.1.0\n\n" + BEGIN)
        assert "- `t-cu128-28`: its build job failed at step `cibuildwheel`" in rel["body"]
        # the failed job re-run (same run: the others' outputs kept), then publish again
        shutil.rmtree(arts / "wheel-t-cu128-28")
        lines[2] = _build_job(arts, "t-cu128-28")[1]
        outputs = _outputs(lines)
        p = _gather(arts, tmp_path / "wheels", outputs)
        assert p.returncode == 0 and "gathered 3 wheel(s)" in p.stdout, p.stderr
        uploads = gh.uploads()
        assert publish_main([*args[:-1], outputs, "--api-url", gh.api_url]) == 0
        assert gh.uploads() - uploads == 3  # the new wheel, its record, SHA256SUMS
        (rel,) = gh.release_by_tag(FULL, "v0.1.0")
        assert rel["body"] == "sageattn3 0.1.0\n" and sum(n.endswith(".whl") for n in gh.asset_files(FULL, rel["id"])) == 3


def test_no_verified_build_publishes_nothing(tmp_path):
    arts = tmp_path / "artifacts"
    lines = [_build_job(arts, t, fail_at="cibuildwheel")[1] for t in TARGETS]
    p = _gather(arts, tmp_path / "wheels", _outputs(lines))
    assert p.returncode == 1 and "no build job verified its wheel" in p.stderr
    assert not (tmp_path / "wheels").exists()


def _index_build(wheels: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ci.index", "build", "--wheels", str(wheels), "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def _published_site(gh: GitHubStandin, site: Path) -> Path:
    for rel, data in gh.branch_files(FULL, "gh-pages").items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    return site


def test_the_index_page_names_a_missing_target_with_its_step_until_a_re_run_publishes_it(tmp_path, capsys, monkeypatch):
    """The release's index (python -m ci.index build with the plan and the jobs' outputs, then
    publish pages) names the target whose build failed, with the step, from the same outcomes
    as the release notes; after the re-run, a fresh runner's index drops it."""
    import urllib.request

    from ci.stages.provenance import missing_targets
    from ci.stages.record import load_records
    from conftest_publish import serve_dir

    arts = tmp_path / "artifacts"
    lines = [_build_job(arts, "t-cu130")[1], _build_job(arts, "t-cu128")[1],
             _build_job(arts, "t-cu128-28", fail_at="cibuildwheel")[1]]
    outputs = _outputs(lines)
    assert _gather(arts, tmp_path / "wheels", outputs).returncode == 0
    release = ["--plan", json.dumps(PLAN), "--build-outputs", outputs]
    p = _index_build(tmp_path / "wheels", tmp_path / "index", *release)
    assert p.returncode == 0, p.stderr
    why = "its build job failed at step `cibuildwheel`"
    assert f"not in this release yet (named on the index page): t-cu128-28: {why}" in p.stdout
    # one source of truth: what the notes name (check_for_release -> missing_targets) is what the index holds
    notes_missing = missing_targets(load_records(tmp_path / "wheels"), outputs, PLAN)
    assert notes_missing == {"t-cu128-28": why}
    assert json.loads((tmp_path / "index" / "index.json").read_text())["missing"] == {"0.1.0": notes_missing}
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    with GitHubStandin(TOKEN) as gh:
        gh.add_repo(FULL)
        pages = ["pages", "--repo", FULL, "--api-url", gh.api_url, "--write-interval", "0"]
        assert publish_main([*pages, "--index", str(tmp_path / "index")]) == 0
        with serve_dir(_published_site(gh, tmp_path / "site1")) as url:
            root = urllib.request.urlopen(url, timeout=30).read().decode()
            assert "Not in release 0.1.0 yet (1 target)" in root
            assert ('<li data-target="t-cu128-28"><code>t-cu128-28</code>: its build job failed at step '
                    "<code>cibuildwheel</code></li>") in root
            assert "t-cu130</code>:" not in root and "t-cu128</code>:" not in root  # the published ones are not named
        # the failed job re-run; the publish job of that attempt builds its index on a fresh runner
        shutil.rmtree(arts / "wheel-t-cu128-28")
        lines[2] = _build_job(arts, "t-cu128-28")[1]
        outputs = _outputs(lines)
        assert _gather(arts, tmp_path / "wheels2", outputs).returncode == 0
        p = _index_build(tmp_path / "wheels2", tmp_path / "index2", "--plan", json.dumps(PLAN), "--build-outputs", outputs)
        assert p.returncode == 0 and "not in this release yet" not in p.stdout, p.stdout + p.stderr
        assert publish_main([*pages, "--index", str(tmp_path / "index2")]) == 0
        with serve_dir(_published_site(gh, tmp_path / "site2")) as url:
            root = urllib.request.urlopen(url, timeout=30).read().decode()
            published = json.loads(urllib.request.urlopen(f"{url}index.json", timeout=30).read())
        assert "Not in release" not in root and "t-cu128-28" not in root and "missing" not in published
        assert sum(1 for w in published["wheels"].values() if w["target"] == "t-cu128-28") == 1


def test_a_later_release_keeps_an_earlier_partial_release_named_and_a_published_wheel_drops_it(tmp_path):
    from ci import index as ix
    from ci.stages.record import load_records

    w1, w2 = tmp_path / "w1", tmp_path / "w2"
    sage_wheel(w1, TARGETS["t-cu130"], "0.1.0", target="t-cu130")
    ix.write_index(load_records(w1), w1, tmp_path / "index", missing={"t-cu128": "its build job failed at step `collect`"})
    sage_wheel(w2, TARGETS["t-cu130"], "0.2.0", target="t-cu130")
    ix.write_index(load_records(w2), w2, tmp_path / "index", missing={})  # 0.2.0 is complete
    root = (tmp_path / "index" / "index.html").read_text()
    assert "Not in release 0.1.0 yet (1 target)" in root and "Not in release 0.2.0" not in root
    assert "<code>t-cu128</code>: its build job failed at step <code>collect</code>" in root
    # the 0.1.0 wheel of t-cu128 indexed later (without a plan): the mention goes
    sage_wheel(w1, TARGETS["t-cu128"], "0.1.0", target="t-cu128")
    ix.write_index(load_records(w1), w1, tmp_path / "index")
    assert "Not in release" not in (tmp_path / "index" / "index.html").read_text()
    # a plan needs the wheels of one release, and says so
    both = tmp_path / "both"
    for d in (w1, w2):
        for f in d.iterdir():
            both.mkdir(exist_ok=True)
            shutil.copy2(f, both / f.name)
    p = _index_build(both, tmp_path / "index3", "--plan", json.dumps(PLAN))
    assert p.returncode == 2 and "need the wheels of exactly one release, these are of 0.1.0, 0.2.0" in p.stderr


def test_a_failed_legs_step_arrives_through_its_outcome_file_and_a_file_never_vouches(tmp_path):
    """GitHub passes a matrix leg's job outputs on only when the leg succeeded: the failed job's
    ``failed:<step>`` reaches the publish job as its outcome-<id> file (``outcome --outcome-dir``),
    read only as the reason a target is missing; a hash in such a file vouches for nothing."""
    arts, outcomes = tmp_path / "artifacts", tmp_path / "outcomes"
    ok = _build_job(arts, "t-cu130")[1]
    _build_job(arts, "t-cu128")
    steps = json.loads(OK_STEPS) | {"cibuildwheel": {"outcome": "failure"}}
    shutil.rmtree(arts / "wheel-t-cu128-28", ignore_errors=True)
    (arts / "wheel-t-cu128-28").mkdir()
    p = subprocess.run([sys.executable, "-m", "ci.release", "outcome", "--target", "t-cu128-28", "--steps",
                        json.dumps(steps), "--artifact", str(arts / "wheel-t-cu128-28"), "--outcome-dir", str(outcomes)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and (outcomes / output_key("t-cu128-28")).read_text().strip() == "failed:cibuildwheel"
    # t-cu128 succeeded but its artifact's hash is only in a file: not vouched for, so not published
    sha = BuildRecord.load(record_path(next((arts / "wheel-t-cu128").glob("*.whl")))).sha256
    (outcomes / output_key("t-cu128")).write_text(f"sha256:{sha}\n")
    outputs = _outputs([ok])  # what GitHub passes on: the succeeded legs whose output it kept
    without = _gather(arts, tmp_path / "w1", outputs)
    assert without.returncode == 0, without.stderr
    assert "t-cu128-28: its build job reported no outcome" in without.stdout
    with_files = subprocess.run([sys.executable, "-m", "ci.release", "gather", "--plan", json.dumps(PLAN), "--artifacts",
                                 str(arts), "--out", str(tmp_path / "w2"), "--build-outputs", outputs,
                                 "--failed-steps", str(outcomes)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert with_files.returncode == 0, with_files.stderr
    assert "gathered 1 wheel(s)" in with_files.stdout
    assert "not published: t-cu128-28: its build job failed at step `cibuildwheel`" in with_files.stdout
    assert "not published: t-cu128: its build job reported no outcome" in with_files.stdout
    # a file never overrides what the job outputs say
    (outcomes / output_key("t-cu130")).write_text("failed:cibuildwheel\n")
    again = subprocess.run([sys.executable, "-m", "ci.release", "gather", "--plan", json.dumps(PLAN), "--artifacts",
                            str(arts), "--out", str(tmp_path / "w3"), "--build-outputs", outputs,
                            "--failed-steps", str(outcomes)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "gathered 1 wheel(s)" in again.stdout, again.stderr
