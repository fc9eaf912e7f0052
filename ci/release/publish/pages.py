"""Publishing the pip index to the GitHub Pages branch through the git database API: one
commit per run, made of blobs -> tree (on top of the current tree) -> commit -> ref update.

The published index is merged, never overwritten: the branch's ``index.json`` is read, the
locally built index (``python -m ci.index``) is merged into it (earlier wheels kept, a changed
sha256 under a published name refused, ``remove`` drops named wheels), and only files whose
git blob id differs are sent. A ``.nojekyll`` file at the branch root keeps Pages from
running Jekyll over the tree. The documentation goes beside the index as HTML, under ``docs/``
(``ci.release.docs_site``); a page no longer produced there is deleted. Nothing changed -> no commit.
A run killed before the ref update leaves the branch untouched (blobs and trees are
unreferenced); the next run redoes it. A ref that moved meanwhile (not a fast-forward) makes
the run start over once.

Limits (checked before any write): a file over 100 MB cannot go into a repository through
the API; a Pages site should stay under 1 GB (warned).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ci.release.docs_site as docs_site
from ci.index import MANIFEST, IndexError_, check_manifest, manifest_entries, site_files
from ci.release.publish._net import InputError, PublishError, RetryPolicy, Throttle, retrying
from ci.release.publish.github import DEFAULT_API
from ci.runtime.log import default_log

MAX_BLOB = 100 * 1000 * 1000
SITE_WARN = 1000 * 1000 * 1000


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class PagesOptions:
    repo: str
    index: Path = Path("dist/index")
    branch: str = "gh-pages"
    prefix: str = ""
    base_url: str | None = None
    message: str = "index: update"
    remove: tuple[str, ...] = ()
    api_url: str = DEFAULT_API
    dry_run: bool = False
    retry: RetryPolicy = RetryPolicy()
    write_interval: float = 1.0
    timeout: int = 60


@dataclass
class PagesSummary:
    branch: str
    commit: str | None = None
    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    added_wheels: list[str] = field(default_factory=list)
    unchanged: int = 0
    dry_run: bool = False

    def line(self) -> str:
        if self.dry_run:
            return (f"pages {self.branch} (dry run): would write {len(self.written)} files, delete {len(self.deleted)}, "
                    f"add {len(self.added_wheels)} wheels")
        if self.commit is None:
            return f"pages {self.branch}: up to date ({self.unchanged} files unchanged), no commit"
        return (f"pages {self.branch}: commit {self.commit[:12]}: {len(self.written)} files written, "
                f"{len(self.deleted)} deleted, {len(self.added_wheels)} wheels added, {self.unchanged} unchanged")


def publish_pages(opts: PagesOptions, token: str | None, log: Callable[[str], None] = default_log) -> PagesSummary:
    try:
        return _publish(opts, token, log)
    except _Moved:
        log(f"  {opts.branch} moved while publishing; starting over")
        return _publish(opts, token, log)


class _Moved(Exception):
    pass


def _publish(opts: PagesOptions, token: str | None, log: Callable[[str], None]) -> PagesSummary:
    from github import Auth, Github, GithubException

    gh = Github(base_url=opts.api_url.rstrip("/"), auth=Auth.Token(token) if token else None, timeout=opts.timeout,
                retry=None, seconds_between_requests=None, seconds_between_writes=None, lazy=True)
    throttle = Throttle(opts.write_interval)
    call = lambda fn, what: retrying(fn, what, opts.retry, log=log)  # noqa: E731
    # Read first: a missing repository (or one the token cannot see) is told apart from a
    # missing branch, which also answers 404.
    repo = call(lambda: gh.get_repo(opts.repo).complete(), f"{opts.repo}: read the repository")
    prefix = opts.prefix.strip("/")
    pre = prefix + "/" if prefix else ""
    summary = PagesSummary(opts.branch, dry_run=opts.dry_run)

    def head() -> str | None:
        try:
            return repo.get_git_ref(f"heads/{opts.branch}").object.sha
        except GithubException as e:
            if e.status == 404:
                return None
            raise
    parent_sha = call(head, f"read branch {opts.branch}")
    remote: dict[str, str] = {}  # path -> blob sha
    base_tree = None
    if parent_sha:
        commit = call(lambda: repo.get_git_commit(parent_sha), "read the branch's commit")
        base_tree = call(lambda: repo.get_git_tree(commit.tree.sha, recursive=True), "read the branch's tree")
        if getattr(base_tree, "raw_data", {}).get("truncated"):
            raise PublishError(f"{opts.branch}: the tree is too large to read in one request; prune old releases")
        remote = {e.path: e.sha for e in base_tree.tree if e.type == "blob"}
    manifest = None
    if pre + MANIFEST in remote:
        where = f"{opts.repo} {opts.branch}:{pre}{MANIFEST}"
        blob = call(lambda: repo.get_git_blob(remote[pre + MANIFEST]), f"read {where}")
        try:  # what the branch holds is checked here: a damaged one is the branch's problem, not the input's
            manifest = check_manifest(json.loads(base64.b64decode(blob.content).decode("utf-8")), where)
            manifest_entries(manifest, where)
        except (ValueError, UnicodeDecodeError) as e:  # IndexError_, JSONDecodeError, binascii.Error
            raise PublishError(f"{e if isinstance(e, IndexError_) else f'{where}: not a readable index manifest ({e})'}; "
                               "repair or revert that file on the branch, then re-run") from None
    try:
        files, deletions, added = site_files(opts.index, manifest, base_url=opts.base_url, remove=opts.remove)
        docs, stale_docs = docs_site.for_branch(set(remote), pre, opts.repo)  # these pages, beside the index
    except (IndexError_, docs_site.DocsError) as e:  # the local index, or what it asks of the published one
        raise InputError(str(e)) from None
    summary.added_wheels = added
    files = {pre + k: v for k, v in files.items()} | docs
    if ".nojekyll" not in remote:
        files[".nojekyll"] = b""
    total = 0
    changes: list[tuple[str, bytes]] = []
    for path, content in sorted(files.items()):
        data = content.read_bytes() if isinstance(content, Path) else content
        if len(data) > MAX_BLOB:
            raise InputError(f"{path}: {len(data) / 1e6:.0f} MB; a repository file must be < 100 MB. Nothing was written")
        total += len(data)
        if remote.get(path) == git_blob_sha(data):
            summary.unchanged += 1
        else:
            changes.append((path, data))
    removals = sorted({pre + d for d in deletions if pre + d in remote} | stale_docs)
    if total > SITE_WARN:
        log(f"  warning: the index is {total / 1e9:.2f} GB; GitHub Pages sites should stay under 1 GB "
            "(remove old versions with --remove)")
    summary.written = [p for p, _ in changes]
    summary.deleted = removals
    if opts.dry_run or (not changes and not removals):
        return summary

    summary.commit = _commit_changes(repo, opts, changes, removals, base_tree, parent_sha, head, call, throttle)
    return summary


def _commit_changes(repo, opts: PagesOptions, changes: list[tuple[str, bytes]], removals: list[str], base_tree,
                    parent_sha: str | None, head: Callable[[], str | None], call, throttle) -> str:
    """One commit on the branch: a blob per changed file, a tree on the branch's, the commit,
    then the branch moved to it without force (created when it did not exist); a move that
    landed but whose answer was lost is recognised by reading the branch. Returns its sha."""
    from github import GithubException, InputGitTreeElement

    elements = []
    for path, data in changes:
        def make_blob(data=data):
            throttle()
            return repo.create_git_blob(base64.b64encode(data).decode(), "base64").sha
        sha = call(make_blob, f"blob {path}")
        elements.append(InputGitTreeElement(path, "100644", "blob", sha=sha))
    for path in removals:
        elements.append(InputGitTreeElement(path, "100644", "blob", sha=None))

    def make_tree():
        throttle()
        return repo.create_git_tree(elements, base_tree) if base_tree is not None else repo.create_git_tree(elements)
    tree = call(make_tree, "tree")
    parents = [call(lambda: repo.get_git_commit(parent_sha), "parent")] if parent_sha else []

    def make_commit():
        throttle()
        return repo.create_git_commit(opts.message, tree, parents)
    new = call(make_commit, "commit")

    def move_ref():
        throttle()
        if parent_sha is None:
            try:
                repo.create_git_ref(f"refs/heads/{opts.branch}", new.sha)
            except GithubException as e:
                if e.status == 422 and head() == new.sha:
                    return
                if e.status == 422:
                    raise _Moved() from None
                raise
            return
        try:
            ref = repo.get_git_ref(f"heads/{opts.branch}").complete()  # its url becomes .../git/refs/heads/…
            ref.edit(new.sha, force=False)
        except GithubException as e:
            if e.status == 422:
                if head() == new.sha:  # an earlier attempt landed, its answer was lost
                    return
                raise _Moved() from None
            raise
    call(move_ref, f"update {opts.branch}")
    return new.sha
