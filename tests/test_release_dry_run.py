"""End to end: the release pipeline's dry run (`nox -s release -- --dry-run`) for the targets
this machine can build: plan -> cibuildwheel's steps through the factory (build, repair + tag,
verify) -> artifact -> gather -> publish to a local server speaking GitHub's REST contract ->
index on the Pages branch -> summary. Then a re-run publishes nothing new."""

import hashlib
import json
import secrets
import shutil
import sys
from pathlib import Path

import pytest

from ci.build import local_blockers
from ci.release import dry_run, publish_steps
from ci.targets import Matrix
from fake_github import FakeGitHub

LOCAL = [t.id for t in Matrix.load().targets if not local_blockers(t)]
pytestmark = [
    pytest.mark.skipif(not LOCAL, reason="no target of the matrix is buildable on this machine"),
    pytest.mark.skipif(not shutil.which("nvcc"), reason="needs a CUDA 13.0 toolkit"),
]
REPO_NAME = "octo/sageattn3"


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    token = "ghs_" + secrets.token_hex(18)
    dist = tmp_path_factory.mktemp("release") / "dist"
    logs: list[str] = []
    with FakeGitHub(token) as fake:
        dr = dry_run(dist, verify_pythons=["%d.%d" % sys.version_info[:2]], fake=fake, repo=REPO_NAME,
                     log=lambda m: logs.append(str(m)))
        yield dr, fake, token, logs


def test_every_local_target_went_through_each_stage(released):
    dr, _, _, _ = released
    assert [e["id"] for e in dr.planned["include"]] == LOCAL
    assert not dr.errors
    for tid in LOCAL:
        assert set(dr.timings[tid]) == {"build", "repair+tag", "verify", "collect"}
        art = dr.artifacts / f"wheel-{tid}"
        wheels = list(art.glob("*.whl"))
        assert len(wheels) == 1 and Path(str(wheels[0]) + ".json").exists()
        rec = json.loads(Path(str(wheels[0]) + ".json").read_text())
        assert rec["target"] == tid and "manylinux" in wheels[0].name


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
    assert f"Published {dr.tag}" in text and "pip install sageattn3 --index-url" in text
    assert (dr.dist / "SHA256SUMS").read_text().count("\n") == len(dr.wheels)
    assert token not in text and all(token not in line for line in logs)


def test_a_rerun_of_the_publish_steps_uploads_nothing(released):
    dr, fake, token, _ = released
    uploads = fake.uploads()
    site = fake.branch_files(REPO_NAME, "gh-pages")
    lines = publish_steps(dr.dist / "wheels", dr.dist / "index", fake.api_url, REPO_NAME, dr.tag, token,
                          log=lambda m: None)
    assert fake.uploads() == uploads
    assert "uploaded 0" in lines[0]
    assert fake.branch_files(REPO_NAME, "gh-pages") == site
