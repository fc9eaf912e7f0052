"""GitHub Releases and the Pages branch, through PyGithub, against the loopback fake of
GitHub's REST contract (ci/release/github_standin.py): idempotency, resumption after an exception
and after a real process kill, faults, limits, dry runs and token secrecy."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import signal
import string
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ci import index as ix
from ci.release.publish import PublishError, ReleaseOptions, RetryPolicy, publish_release
from ci.release.publish.__main__ import main as publish_main
from ci.release.publish._net import InputError, retrying
from ci.release.publish.github import SUMS, LocalAsset, ReleasePublisher, parse_sums
from ci.release.publish.pages import PagesOptions, publish_pages
from ci.stages.record import load_records
from conftest_publish import REPO, sage_wheel, serve_dir
from ci.release.github_standin import GitHubStandin
from github_faults import FaultyGitHub

pytestmark = pytest.mark.timeout(180)  # pytest-timeout (ci/requirements-test.txt)

TOKEN = "ghp_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(36))
FULL = "octo/sageattn3"
VARIANTS = ("cu130.torch2.10.stable", "cu128.torch2.10.stable", "cu128.torch2.8")
FAST = RetryPolicy(attempts=5, backoff=0.01, max_backoff=0.05, max_wait=5)


@pytest.fixture
def gh():
    with FaultyGitHub(TOKEN) as server:
        server.add_repo(FULL)
        yield server


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    for v in VARIANTS:
        sage_wheel(d, v, payload=os.urandom(2048))
    return d


def opts(gh: GitHubStandin, wheels: Path, **kw) -> ReleaseOptions:
    # these tests publish the stand-in's own wheels: no build job's outputs vouch for them
    base = dict(repo=FULL, tag="v1.0.0", wheels=wheels, api_url=gh.api_url, retry=FAST, write_interval=0, concurrency=3,
                allow_local_build=True)
    base.update(kw)
    return ReleaseOptions(**base)


def expected_assets(wheels: Path) -> dict[str, str]:
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in wheels.iterdir() if p.suffix in (".whl", ".json")}
    return out


def assert_complete(gh: GitHubStandin, wheels: Path, tag: str = "v1.0.0") -> None:
    rels = gh.release_by_tag(FULL, tag)
    assert len(rels) == 1, "exactly one release for the tag"
    rel = rels[0]
    assert rel["draft"] is False, "published"
    files = gh.asset_files(FULL, rel["id"])  # asserts no duplicate names
    want = expected_assets(wheels)
    assert set(files) == set(want) | {SUMS}
    for name, sha in want.items():
        assert hashlib.sha256(files[name]).hexdigest() == sha, name
    assert parse_sums(files[SUMS]) == want
    with gh.lock:
        assert all(a["state"] == "uploaded" for a in gh.repos[FULL].assets.values())


def writes(gh: GitHubStandin) -> int:
    return sum(gh.count(m) for m in ("POST", "PATCH", "DELETE", "PUT"))


def test_publish_then_rerun_makes_zero_uploads(gh, wheels):
    s = publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    assert s.created and s.published and len(s.uploaded) == 7 and not s.failed
    assert_complete(gh, wheels)
    n_uploads, n_writes, n_all = gh.uploads(), writes(gh), gh.count()
    s = publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    assert s.uploaded == [] and len(s.skipped) == 7 and s.already_published
    assert gh.uploads() == n_uploads and writes(gh) == n_writes
    assert gh.count() - n_all == 2  # list releases + list assets (one page each)
    assert_complete(gh, wheels)


def test_dry_run_prints_the_plan_and_writes_nothing(gh, wheels, capsys):
    p = subprocess.run([sys.executable, "-m", "ci.release.publish", "--tag", "v1.0.0", "--repo", FULL, "--api-url", gh.api_url,
                        "--wheels", str(wheels), "--dry-run", "--allow-local-build"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GITHUB_TOKEN": TOKEN})
    assert p.returncode == 0, p.stderr
    assert "create   release v1.0.0" in p.stdout and p.stdout.count("upload   ") == 6 and "write    SHA256SUMS" in p.stdout
    assert writes(gh) == 0 and gh.release_by_tag(FULL, "v1.0.0") == []


def _rebuild_one(wheels: Path, tmp_path: Path) -> Path:
    """The cu128.torch2.8 wheel rebuilt with other bytes (same name), record beside it."""
    victim = next(wheels.glob("*cu128.torch2.8*.whl"))
    rebuilt = tmp_path / "rebuilt"
    sage_wheel(rebuilt, "cu128.torch2.8", payload=os.urandom(64))
    for p in rebuilt.iterdir():
        (wheels / p.name).write_bytes(p.read_bytes())
    return victim


def test_changed_content_is_refused_and_replace_on_a_published_release_needs_a_second_flag(gh, wheels, tmp_path):
    publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    victim = _rebuild_one(wheels, tmp_path)
    before = gh.uploads(), writes(gh)
    with pytest.raises(PublishError, match="different content.*Nothing was uploaded.*--replace"):
        publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    # --replace alone: the release is published, so it is refused too, before any write
    with pytest.raises(InputError, match=r"v1\.0\.0 is published.*Nothing was uploaded.*--replace-published"):
        publish_release(opts(gh, wheels, replace=True), TOKEN, log=lambda m: None)
    assert (gh.uploads(), writes(gh)) == before
    # the CLI says so with exit status 2
    cmd, env = _cli(gh, wheels, "--replace")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--replace-published" in p.stderr and (gh.uploads(), writes(gh)) == before
    # both flags: replaced, and each replaced asset is logged with what it was and what it becomes
    p = subprocess.run(_cli(gh, wheels, "--replace", "--replace-published")[0], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for name in (victim.name, victim.name + ".json"):
        sha = hashlib.sha256((wheels / name).read_bytes()).hexdigest()
        assert re.search(rf"^  {re.escape(name)}: replacing the asset of the PUBLISHED release v1\.0\.0 "
                         rf"\(\d+ bytes, sha256:[0-9a-f]{{64}} -> \d+ bytes, sha256:{sha}\)$", p.stdout, re.M), p.stdout
    assert "replaced 3" in p.stdout  # the wheel, its record, SHA256SUMS
    assert_complete(gh, wheels)


def test_prune_with_replace_published_never_replaces_changed_assets(gh, wheels, tmp_path):
    """--replace-published widens --prune or --replace; with --prune alone it deletes what
    this run lacks but replaces nothing: an asset with other content is still refused."""
    publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    _rebuild_one(wheels, tmp_path)  # other content under a published name
    gone = next(wheels.glob("*cu128.torch2.10*.whl"))  # and a wheel this run no longer has
    for p in (gone, gone.with_name(gone.name + ".json")):
        p.unlink()
    files = gh.asset_files(FULL, gh.release_by_tag(FULL, "v1.0.0")[0]["id"])
    before = gh.uploads(), writes(gh)
    with pytest.raises(InputError, match="different content under 2 name.*Nothing was uploaded"):
        publish_release(opts(gh, wheels, prune=True, replace_published=True), TOKEN, log=lambda m: None)
    cmd, env = _cli(gh, wheels, "--prune", "--replace-published")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "different content" in p.stderr, p.stderr  # bad input, not a server failure
    assert (gh.uploads(), writes(gh)) == before
    assert gh.asset_files(FULL, gh.release_by_tag(FULL, "v1.0.0")[0]["id"]) == files


def test_replace_on_a_draft_needs_no_second_flag(gh, wheels, tmp_path):
    gh.inject("503", "POST", r"^/api/uploads/.*SHA256SUMS", times=100)  # stops short of publishing
    with pytest.raises(PublishError):
        publish_release(opts(gh, wheels, retry=RetryPolicy(attempts=2, backoff=0.01)), TOKEN, log=lambda m: None)
    assert gh.release_by_tag(FULL, "v1.0.0")[0]["draft"] is True
    gh.faults.clear()
    victim = _rebuild_one(wheels, tmp_path)
    logs: list[str] = []
    s = publish_release(opts(gh, wheels, replace=True), TOKEN, log=logs.append)
    assert sorted(s.replaced) == sorted([victim.name, victim.name + ".json"]) and s.published
    assert any(m.startswith(f"  {victim.name}: replacing the asset of the draft release v1.0.0") for m in logs)
    assert_complete(gh, wheels)


def test_faults_are_retried_and_end_in_the_exact_state(gh, wheels):
    gh.inject("429", "POST", r"/releases(\?|$)", retry_after=1)             # create: secondary rate limit
    gh.inject("drop_after", "POST", r"/releases(\?|$)")                     # create lands, answer lost
    gh.inject("403", "GET", r"/assets(\?|$)", retry_after=1)               # listing: secondary rate limit
    gh.inject("500", "POST", r"^/api/uploads/", times=2)
    gh.inject("drop", "POST", r"^/api/uploads/")                      # connection dropped, nothing stored
    gh.inject("drop_after", "POST", r"^/api/uploads/")                # stored, answer lost
    gh.inject("partial", "POST", r"^/api/uploads/")                   # half an asset left in state starter
    gh.inject("slow", "POST", r"^/api/uploads/", delay=0.5)
    gh.inject("502", "PATCH", r"/releases/\d+$")                      # publish
    logs: list[str] = []
    t0 = time.monotonic()
    s = publish_release(opts(gh, wheels), TOKEN, log=logs.append)
    assert time.monotonic() - t0 >= 2.0  # two Retry-After: 1 honoured
    assert not s.failed and s.published
    assert all(f.times == 0 for f in gh.faults), [f for f in gh.faults if f.times]
    assert_complete(gh, wheels)
    assert len([r for r in gh.repos[FULL].releases.values()]) == 1  # the lost-answer create was not repeated
    retries = [m for m in logs if ": retry " in m]
    subject = r"(\S+\.whl(\.json)?|SHA256SUMS|release v1\.0\.0|octo/sageattn3)"  # what each retry is about, first
    assert retries and all(re.match(rf"^  {subject}: [a-z][a-z ]*: retry \d+/\d+ in \d+\.\d+s \(.+\)$", m)
                           for m in retries), retries
    names = set(expected_assets(wheels)) | {SUMS}
    uploads = [m for m in retries if ": upload: retry" in m]
    assert uploads and all(m.split(":")[0].strip() in names for m in uploads), uploads


class _TwoPartWriter:
    """Writes a message, then (a moment later) its newline, as print() does: without a lock
    around each line, lines of concurrent threads run into each other."""

    def __init__(self) -> None:
        self.text = ""

    def __call__(self, msg: str) -> None:
        self.text += msg
        time.sleep(0.002)
        self.text += "\n"


def test_log_lines_of_concurrent_uploads_never_interleave(gh, wheels):
    for _ in range(2):
        gh.inject("500", "POST", r"^/api/uploads/", times=6)  # several threads retrying at once
    out = _TwoPartWriter()
    publish_release(opts(gh, wheels, concurrency=4, retry=RetryPolicy(attempts=8, backoff=0.001, max_backoff=0.002)),
                    TOKEN, log=out)
    names = "|".join(re.escape(n) for n in [*expected_assets(wheels), SUMS])
    line = re.compile(rf"^(created draft release v1\.0\.0 \(id \d+\)|  ({names}): (upload: retry .+|uploaded))$")
    lines = out.text.splitlines()
    assert sum(": retry " in ln for ln in lines) >= 6
    assert [ln for ln in lines if not line.match(ln)] == []


def test_gives_up_with_a_summary_and_finishes_on_rerun(gh, wheels):
    gh.inject("503", "POST", r"^/api/uploads/.*\.json", times=100)
    with pytest.raises(PublishError, match=r"failed 3.*stays a draft.*re-run"):
        publish_release(opts(gh, wheels, retry=RetryPolicy(attempts=2, backoff=0.01)), TOKEN, log=lambda m: None)
    assert gh.release_by_tag(FULL, "v1.0.0")[0]["draft"] is True
    gh.faults.clear()
    s = publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    assert len(s.uploaded) == 4 and len(s.skipped) == 3  # 3 records + SUMS uploaded, wheels skipped
    assert_complete(gh, wheels)


def test_abort_by_exception_midway_then_resume(gh, wheels, monkeypatch):
    real = ReleasePublisher.upload
    calls = {"n": 0}

    def flaky(self, release, la, old):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("operator pressed ^C")
        return real(self, release, la, old)
    monkeypatch.setattr(ReleasePublisher, "upload", flaky)
    with pytest.raises(KeyboardInterrupt):
        publish_release(opts(gh, wheels, concurrency=1), TOKEN, log=lambda m: None)
    rel = gh.release_by_tag(FULL, "v1.0.0")[0]
    n = len(gh.asset_files(FULL, rel["id"]))
    assert rel["draft"] is True and 2 <= n <= 3  # the one already picked up by the worker may finish
    monkeypatch.setattr(ReleasePublisher, "upload", real)
    before = gh.uploads()
    s = publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    assert gh.uploads() - before == 7 - n and len(s.skipped) == n
    assert_complete(gh, wheels)


def _cli(gh, wheels, *extra, env=None):
    e = {**os.environ, "GITHUB_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1", **(env or {})}
    return [sys.executable, "-m", "ci.release.publish", "github", "--tag", "v1.0.0", "--repo", FULL, "--api-url", gh.api_url,
            "--wheels", str(wheels), "--write-interval", "0", "--backoff", "0.01", "--allow-local-build", *extra], e


def test_process_killed_midway_then_resume(gh, wheels):
    gh.inject("slow", "POST", r"^/api/uploads/", delay=0.4, times=100)
    cmd, env = _cli(gh, wheels, "--concurrency", "1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while gh.uploads() < 3 and time.monotonic() < deadline:  # killed during the 4th upload
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    rel = gh.release_by_tag(FULL, "v1.0.0")[0]
    assert rel["draft"] is True
    partial = gh.asset_files(FULL, rel["id"])
    assert 3 <= len(partial) < 7
    gh.faults.clear()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert_complete(gh, wheels)
    before = gh.uploads()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "uploaded 0, skipped 7" in p.stdout
    assert gh.uploads() == before


def test_without_digests_verification_uses_sizes_and_sha256sums(wheels, tmp_path):
    with GitHubStandin(TOKEN, digests=False) as gh:
        gh.add_repo(FULL)
        publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
        assert_complete(gh, wheels)
        dl = gh.count("GET", r"^/download/")
        s = publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
        assert s.uploaded == [] and gh.count("GET", r"^/download/") - dl == 1  # SHA256SUMS only
        # same size, other bytes: found by downloading, refused
        victim = next(wheels.glob("*.whl"))
        data = bytearray(victim.read_bytes())
        rebuilt = tmp_path / "x"
        rebuilt.mkdir()
        # rewrite the record beside it to keep the local pair consistent
        from ci.stages.record import BuildRecord, record_path
        rec = BuildRecord.load(record_path(victim))
        # the first member's modification time in its local header: other bytes, same size,
        # every member and RECORD hash still right (a byte of content would be refused
        # locally, by the RECORD check, before any request)
        assert data[:4] == b"PK\x03\x04"
        data[10] ^= 0x01
        victim.write_bytes(bytes(data))
        record_path(victim).write_text(rec.with_wheel(victim).to_json())
        with pytest.raises(PublishError, match="different content"):
            publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)


def test_pagination_and_duplicate_empty_drafts(wheels):
    with GitHubStandin(TOKEN, per_page_max=2) as gh:
        repo = gh.add_repo(FULL)
        for i in range(5):
            repo.releases[gh.next_id()] = {"id": None, "tag_name": f"v0.{i}", "target_commitish": "main", "name": "",
                                           "body": "", "draft": False, "prerelease": False, "created_at": "", "published_at": ""}
        for rid, rel in repo.releases.items():
            rel["id"] = rid
        for _ in range(2):  # two drafts for our tag: a create retried after a lost answer
            rid = gh.next_id()
            repo.releases[rid] = {"id": rid, "tag_name": "v1.0.0", "target_commitish": "main", "name": "v1.0.0", "body": "",
                                  "draft": True, "prerelease": False, "created_at": "", "published_at": None}
        publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
        assert_complete(gh, wheels)
        assert gh.count("GET", r"/releases(\?|$)") >= 4  # pages of 2 followed through Link headers
        n = gh.uploads()
        publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
        assert gh.uploads() == n


def test_limits_refused_before_any_upload(gh, wheels):
    pub = ReleasePublisher(opts(gh, wheels), TOKEN, log=lambda m: None)
    big = LocalAsset("sageattn3-1.0.0-cp310-abi3-linux_x86_64.whl", "0" * 64, 2 * 1024**3, "wheel")
    # input problems (InputError: exit status 2), not server failures
    with pytest.raises(InputError, match="< 2 GiB"):
        pub.plan([big], None, {})
    many = [LocalAsset(f"w{i}.whl", "0" * 64, 10, "wheel") for i in range(1000)]
    with pytest.raises(InputError, match="1001 assets.*1000 per release"):
        pub.plan(many, None, {})
    assert pub.plan(many[:999], None, {})  # 999 + SHA256SUMS = 1000: allowed
    with pytest.raises(InputError, match="rename"):
        pub.plan([LocalAsset("bad name.whl", "0" * 64, 1, "wheel")], None, {})
    assert writes(gh) == 0


def test_a_403_that_is_no_rate_limit_is_not_retried_and_says_what_to_check():
    """A 403 without Retry-After or rate-limit wording (a token without contents: write)
    answers the same however often it is asked: one attempt, then what to check."""
    from github import GithubException

    calls = []

    def upload():
        calls.append(1)
        raise GithubException(403, {"message": "Resource not accessible by integration"}, {})
    with pytest.raises(PublishError, match=r"^w\.whl: upload: HTTP 403 \(Resource not accessible by integration\): "
                                           r"the token may not do this: it needs contents: write"):
        retrying(upload, "w.whl: upload", FAST, log=lambda m: None, sleep=lambda s: None)
    assert calls == [1]


def test_token_never_leaks(gh, wheels, tmp_path):
    log_file = tmp_path / "publish.log"
    cmd, env = _cli(gh, wheels, env={"SAGEATTN3_PUBLISH_LOG": "DEBUG", "SAGEATTN3_PUBLISH_TRACEBACK": "1"})
    gh.inject("500", "POST", r"^/api/uploads/", times=1)
    with open(log_file, "w") as f:
        ok = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=120)
    assert ok.returncode == 0
    # a failing run: every upload answered 500 until it gives up; the exception path prints
    gh.inject("500", "POST", r"^/api/uploads/", times=1000)
    w2, w3 = tmp_path / "w2", tmp_path / "w3"
    for v in VARIANTS:
        sage_wheel(w2, v, "2.0.0")
        sage_wheel(w3, v, "3.0.0")
    cmd2, _ = _cli(gh, w2, "--tag", "v2.0.0", "--retries", "2")
    bad = subprocess.run(cmd2, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "still failing" in bad.stdout + bad.stderr and "failed 6" in bad.stderr
    # in-process: the exception text
    with pytest.raises(PublishError) as ei:
        publish_release(opts(gh, w3, tag="v3.0.0", retry=RetryPolicy(attempts=2, backoff=0.01)), TOKEN, log=lambda m: None)
    import traceback
    texts = [log_file.read_text(), bad.stdout, bad.stderr, str(ei.value), repr(ei.value),
             "".join(traceback.format_exception(ei.value))]
    texts += [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".whl"]
    for t in texts:
        assert TOKEN not in t and TOKEN[4:] not in t
    assert "DEBUG" in log_file.read_text() or "uploaded" in log_file.read_text()
    assert any(r.auth and TOKEN in r.auth for r in gh.requests)  # it was used, only on the wire


# -- the Pages branch ----------------------------------------------------------------------

def _index(tmp_path: Path, version: str, variants) -> Path:
    wd = tmp_path / f"w-{version}"
    for v in variants:
        sage_wheel(wd, v, version)
    out = tmp_path / f"idx-{version}"
    ix.write_index(load_records(wd), wd, out)
    return out


def _pages(gh, index: Path, **kw) -> PagesOptions:
    return PagesOptions(repo=FULL, index=index, api_url=gh.api_url, retry=FAST, write_interval=0,
                        base_url="https://octo.github.io/sageattn3/", **kw)


def test_pages_one_commit_per_release_merging_earlier_ones(gh, tmp_path):
    v1 = _index(tmp_path, "1.0.0", VARIANTS)
    s = publish_pages(_pages(gh, v1, message="index: v1.0.0"), TOKEN, log=lambda m: None)
    assert s.commit and len(s.added_wheels) == 3
    files = gh.branch_files(FULL, "gh-pages")
    assert ".nojekyll" in files and "index.json" in files and "cu130/torch2.14/sageattn3/index.html" in files
    commits = gh.count("POST", r"/git/commits$")
    s = publish_pages(_pages(gh, v1), TOKEN, log=lambda m: None)  # same index again: no commit
    assert s.commit is None and gh.count("POST", r"/git/commits$") == commits
    v2 = _index(tmp_path, "1.1.0", VARIANTS[:1])  # a fresh CI runner knows only the new release
    gh.inject("502", "POST", r"/git/blobs$")
    blobs_before = gh.count("POST", r"/git/blobs")
    s = publish_pages(_pages(gh, v2, message="index: v1.1.0"), TOKEN, log=lambda m: None)
    assert s.commit and s.added_wheels and gh.count("POST", r"/git/commits$") == commits + 1
    # blobs only for what changed: the 1.0.0 wheels were not sent again
    assert not any("1.0.0" in w and w.startswith("files/") for w in s.written)
    assert gh.count("POST", r"/git/blobs") - blobs_before == len(s.written) + 1  # + the 502'd attempt
    files = gh.branch_files(FULL, "gh-pages")
    page = ix.parse_anchors(files["cu130/torch2.14/sageattn3/index.html"])
    assert sorted(a["href"].split("/")[-1].split("-")[1] for a in page) == ["1.0.0%2Bcu130.torch2.10.stable",
                                                                              "1.1.0%2Bcu130.torch2.10.stable"]
    assert "cu128/torch2.8/sageattn3/index.html" in files
    site = tmp_path / "site"
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    with serve_dir(site) as url:
        assert ix.check_index(url, log=lambda *a: None) == 4
        # the docs beside the index, as HTML; links to repository files point at the repository
        page = urllib.request.urlopen(f"{url}docs/publishing.html", timeout=30).read().decode()
        assert "<h1" in page and "https://github.com/octo/sageattn3/blob/HEAD/ci/requirements-publish.txt" in page
        assert 'href="../"' in page and 'href="coverage.html"' in page
    # a page no longer in docs/ goes on the next publish; the index's pages stay
    _commit_to_branch(gh, "docs/renamed-away.html", b"<p>old</p>")
    s = publish_pages(_pages(gh, v2), TOKEN, log=lambda m: None)
    assert s.deleted == ["docs/renamed-away.html"] and not s.written
    assert "docs/renamed-away.html" not in gh.branch_files(FULL, "gh-pages")
    # removal through the branch
    s = publish_pages(_pages(gh, v2, remove=("1.0.0",)), TOKEN, log=lambda m: None)
    files = gh.branch_files(FULL, "gh-pages")
    assert not any(k.startswith("files/sageattn3-1.0.0") for k in files) and "cu128/torch2.8/index.html" not in files


def test_pages_refuses_a_changed_wheel(gh, tmp_path):
    publish_pages(_pages(gh, _index(tmp_path / "a", "1.0.0", VARIANTS[:1])), TOKEN, log=lambda m: None)
    wd = tmp_path / "b"
    sage_wheel(wd, VARIANTS[0], "1.0.0", payload=b"rebuilt")
    out = tmp_path / "b-idx"
    ix.write_index(load_records(wd), wd, out)
    with pytest.raises(PublishError, match="different file"):
        publish_pages(_pages(gh, out), TOKEN, log=lambda m: None)


def test_pages_cli_dry_run(gh, tmp_path):
    v1 = _index(tmp_path, "1.0.0", VARIANTS[:1])
    p = subprocess.run([sys.executable, "-m", "ci.release.publish", "pages", "--repo", FULL, "--index", str(v1), "--api-url",
                        gh.api_url, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GH_TOKEN": TOKEN})
    assert p.returncode == 0, p.stderr
    assert re.search(r"would write \d+ files", p.stdout) and writes(gh) == 0


def test_prune_on_a_published_release_needs_the_second_flag_too(gh, wheels):
    publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
    gone = next(wheels.glob("*cu128.torch2.8*.whl"))
    for p in (gone, gone.with_name(gone.name + ".json")):
        p.unlink()
    before = gh.uploads(), writes(gh)
    with pytest.raises(InputError, match=r"v1\.0\.0 is published: --prune would delete 2 asset.*Nothing was changed"):
        publish_release(opts(gh, wheels, prune=True), TOKEN, log=lambda m: None)
    assert (gh.uploads(), writes(gh)) == before
    s = publish_release(opts(gh, wheels, prune=True, replace_published=True), TOKEN, log=lambda m: None)
    assert not s.failed and gh.count("DELETE") >= 2


def _commit_to_branch(gh, path: str, data: bytes, branch: str = "gh-pages") -> None:
    """One commit changing one file of the branch, through the REST API (as a person would)."""
    from github import Auth, Github, InputGitTreeElement

    repo = Github(base_url=gh.api_url, auth=Auth.Token(TOKEN)).get_repo(FULL)
    ref = repo.get_git_ref(f"heads/{branch}").complete()
    parent = repo.get_git_commit(ref.object.sha)
    blob = repo.create_git_blob(base64.b64encode(data).decode(), "base64")
    tree = repo.create_git_tree([InputGitTreeElement(path, "100644", "blob", sha=blob.sha)],
                                repo.get_git_tree(parent.tree.sha))
    ref.edit(repo.create_git_commit(f"edit {path}", tree, [parent]).sha)


@pytest.mark.parametrize("damage,needle", [
    (lambda m: b"{damaged", "octo/sageattn3 gh-pages:index.json: not a readable index manifest"),
    (lambda m: json.dumps([m]).encode(), "octo/sageattn3 gh-pages:index.json: an index manifest is a JSON object"),
    (lambda m: json.dumps({**m, "wheels": {k: {x: y for x, y in v.items() if x != "target"}
                                            for k, v in m["wheels"].items()}}).encode(), ": field target: missing"),
    (lambda m: json.dumps({**m, "wheels": {k: {**v, "metadata_sha256": None} for k, v in m["wheels"].items()}}).encode(),
     ": field metadata_sha256: null"),
], ids=["not-json", "not-an-object", "entry-without-target", "entry-bad-metadata-sha256"])
def test_pages_over_a_damaged_published_index_names_the_file_and_field(gh, tmp_path, capsys, monkeypatch, damage, needle):
    v1 = _index(tmp_path, "1.0.0", VARIANTS[:1])
    publish_pages(_pages(gh, v1), TOKEN, log=lambda m: None)
    manifest = json.loads(gh.branch_files(FULL, "gh-pages")["index.json"])
    _commit_to_branch(gh, "index.json", damage(manifest))
    head, n_writes = gh.repos[FULL].refs["refs/heads/gh-pages"], writes(gh)
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    rc = publish_main(["pages", "--repo", FULL, "--index", str(v1), "--api-url", gh.api_url, "--write-interval", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err  # the branch's problem: one line, no traceback
    assert needle in err and "repair or revert that file on the branch" in err and "unexpected" not in err, err
    assert gh.repos[FULL].refs["refs/heads/gh-pages"] == head and writes(gh) == n_writes
