"""Publishing wheels to a GitHub Release, idempotently and resumably, through PyGithub.

What a release holds, for tag ``vX.Y.Z``: every wheel of ``dist/wheels``, each wheel's build
record (``<wheel>.json``), and ``SHA256SUMS`` (``sha256sum -c`` format, one line per other
asset of the release).

The rules:

- The release is found by listing releases (drafts are invisible to "get by tag"), or created
  as a **draft**. It is published (``draft: false``) only once every asset is present and
  verified; a release found already published just gets what it lacks.
- Before any request: the repository must be ``OWNER/NAME``, the tag ``v`` + the version of
  every wheel (``v0.1.0`` for ``0.1.0+cu130...``), and every wheel must agree with its
  beside-record (``ci.stages.record.check_wheel``: file name, METADATA, WHEEL tags, the record inside
  the wheel). Anything else is an ``InputError`` and nothing is sent.
- An asset present with the right sha256 is skipped; present with other content is an error
  (nothing is uploaded) unless ``replace``; on a release already published, ``replace`` is
  refused too unless ``replace_published`` says so, and each replaced asset is logged. A
  replacement goes up under a temporary name before the old asset is retired and it is renamed
  into place (``ci.release.publish.replace``: a run stopped at any step loses no bytes, the next run
  finishes it). An upload
  left half-done (``state != uploaded``) is deleted and redone. Names are unique on a release (GitHub answers 422), so there are never
  duplicates; an upload whose answer was lost is reconciled by looking, not by re-sending.
- **How an asset's sha256 is known** (the skip/verify rule): the asset's ``digest``
  (``sha256:…``, returned by current API versions); without it, a size equal to the local
  file and a line for it in the release's ``SHA256SUMS`` with the local sha256 (that file is
  written only after every upload was checked); otherwise the asset is downloaded and hashed.
  A size that differs is a difference without downloading anything.
- ``SHA256SUMS`` is derived, not a build output: it is rewritten (replaced as above) when the
  asset set changes, after every other asset is in place.
- Limits, checked before any upload: every asset < 2 GiB; at most 1000 assets on the release
  after this run (policy: refuse with a message, never split a release across tags; 1000
  assets is 499 wheels with their records). Names must be plain (``[A-Za-z0-9._+-]``) because
  GitHub silently renames others, which would defeat the by-name idempotency.
- Network: every call retried with exponential backoff on 5xx and dropped connections, after
  ``Retry-After`` on 403/429 secondary rate limits (or until ``X-RateLimit-Reset`` when the
  primary limit is spent), at most ``concurrency`` uploads in flight, and at least
  ``write_interval`` seconds between the starts of mutating requests.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ci.release.publish._net import (TOKEN_VARS, InputError, LineLog, PublishError, RetryPolicy, Throttle, check_repo, classify,
                             retrying)
import ci.release.publish.replace as swap
from ci.release.publish.notes import with_missing
from ci.release.publish.release_api import SUMS, LocalAsset, _Client, _raw, assets_of, check_tag, parse_sums, sums_text
from ci.runtime.log import default_log
from ci.stages.record import RecordError, load_records

MAX_ASSET_BYTES = 2 * 1024**3  # GitHub: each asset < 2 GiB
MAX_ASSETS = 1000  # GitHub: at most 1000 assets per release
NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
DEFAULT_API = "https://api.github.com"


@dataclass(frozen=True)
class ReleaseOptions:
    repo: str
    tag: str
    wheels: Path = Path("dist/wheels")
    api_url: str = DEFAULT_API
    dry_run: bool = False
    replace: bool = False
    replace_published: bool = False  # with replace: also overwrite assets of a published release
    prune: bool = False
    concurrency: int = 4
    name: str | None = None
    notes: str = ""
    prerelease: bool = False
    target_commitish: str | None = None
    retry: RetryPolicy = RetryPolicy()
    write_interval: float = 1.0
    timeout: int = 60
    build_outputs: str | dict | None = None  # the build jobs' outputs: every wheel must be one they verified
    plan: dict | None = None  # the planned targets: those without a wheel are named in the notes
    allow_local_build: bool = False  # publish wheels whose record names a local index


@dataclass
class Summary:
    tag: str
    release_url: str = ""
    created: bool = False
    published: bool = False
    already_published: bool = False
    plan: list[str] = field(default_factory=list)
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    def line(self) -> str:
        state = ("published" if self.published or self.already_published else "left as draft")
        return (f"release {self.tag}: uploaded {len(self.uploaded)}, skipped {len(self.skipped)}, "
                f"replaced {len(self.replaced)}, deleted {len(self.deleted)}, failed {len(self.failed)}"
                + (f", kept {len(self.kept)} not in this run" if self.kept else "")
                + f"; {state}" + (f": {self.release_url}" if self.release_url else ""))


class ReleasePublisher:
    def __init__(self, opts: ReleaseOptions, token: str | None, log: Callable[[str], None] = default_log) -> None:
        self.opts = opts
        self.log = LineLog(log)  # upload threads log too: one whole line per event
        self.client = _Client(opts, token)
        self.throttle = Throttle(opts.write_interval)
        self.summary = Summary(opts.tag)
        self._sums_cache: dict[str, str] | None = None
        self._sums_bytes: bytes | None = None
        self.missing: dict[str, str] = {}  # planned targets without a wheel: id -> why

    # -- reading ---------------------------------------------------------------------------
    def _call(self, fn, what: str, before_retry=None):
        return retrying(fn, what, self.opts.retry, log=self.log, before_retry=before_retry)

    def find_release(self) -> dict | None:
        """The release for the tag (published one first, else the oldest draft). Empty
        duplicate drafts (a create whose answer was lost, then retried) are deleted."""
        def scan() -> list[dict]:
            return [_raw(r) for r in self.client.repo().get_releases() if r.tag_name == self.opts.tag]
        rels = self._call(scan, f"{self.opts.repo}: list releases")
        published = [r for r in rels if not r["draft"]]
        if published:
            return published[0]
        drafts = sorted(rels, key=lambda r: r["id"])
        if not drafts:
            return None
        keep, extra = drafts[0], drafts[1:]
        busy = [r for r in extra if r.get("assets")]
        if busy:
            raise PublishError(f"{len(drafts)} draft releases carry tag {self.opts.tag} and more than one has assets "
                               f"(ids {', '.join(str(r['id']) for r in drafts)}); delete all but one on GitHub, then re-run")
        for r in extra:
            if not self.opts.dry_run:
                self.throttle()
                rel = self.client.release(r)
                self._call(rel.delete_release, f"release {self.opts.tag}: delete duplicate empty draft {r['id']}")
                self.log(f"  deleted a duplicate empty draft release (id {r['id']})")
        return keep

    def list_assets(self, release: dict, what: str | None = None) -> dict[str, dict]:
        def scan() -> dict[str, dict]:
            return {_raw(a)["name"]: _raw(a) for a in self.client.release(release).get_assets()}
        return self._call(scan, what or f"release {self.opts.tag}: list assets")

    def remote_sums(self, assets: dict[str, dict]) -> dict[str, str]:
        if self._sums_cache is None:
            a = assets.get(SUMS)
            self._sums_cache, self._sums_bytes = {}, None
            if a is not None and a.get("state") == "uploaded":
                self._sums_bytes = self._call(lambda: self.client.download(a), f"{SUMS}: download")
                self._sums_cache = parse_sums(self._sums_bytes)
        return self._sums_cache

    def sums_current(self, sums: LocalAsset, assets: dict[str, dict]) -> bool:
        """Is the release's SHA256SUMS exactly ``sums``? (digest, else the one download)"""
        cur = assets.get(SUMS)
        if cur is None or cur.get("state") != "uploaded" or cur.get("size") != sums.size:
            return False
        if cur.get("digest"):
            return cur["digest"] == f"sha256:{sums.sha256}"
        self.remote_sums(assets)
        return self._sums_bytes == sums.data

    def remote_sha256(self, a: dict, local: LocalAsset | None, assets: dict[str, dict]) -> tuple[str | None, str]:
        """(sha256 or None, how it was learnt) of a remote asset; see the module's rule."""
        if a.get("state") != "uploaded":
            return None, f"incomplete upload (state {a.get('state')})"
        digest = a.get("digest")
        if isinstance(digest, str) and digest.startswith("sha256:"):
            return digest.removeprefix("sha256:"), "digest"
        if local is not None and a.get("size") != local.size:
            return f"size:{a.get('size')}", f"size {a.get('size')} != {local.size}"
        listed = self.remote_sums(assets).get(a["name"])
        if local is not None and listed == local.sha256:
            return listed, f"size and {SUMS}"
        import hashlib

        data = self._call(lambda: self.client.download(a), f"{a['name']}: download")
        return hashlib.sha256(data).hexdigest(), "downloaded and hashed"

    # -- planning --------------------------------------------------------------------------
    def plan(self, local: list[LocalAsset], release: dict | None, assets: dict[str, dict]):
        """Classify every local asset; raise before any write on conflicts or limits."""
        uploads: list[tuple[LocalAsset, dict | None, str]] = []  # (asset, remote to delete first, action)
        conflicts = []
        replacing: list[tuple[LocalAsset, str]] = []  # (asset, the remote's sha256 or how it differs)
        for la in local:
            if not NAME_OK.match(la.name):
                raise InputError(f"{la.name}: GitHub would rename this asset (only [A-Za-z0-9._+-] are kept); rename it")
            if la.size >= MAX_ASSET_BYTES:
                raise InputError(f"{la.name}: {la.size / 2**30:.2f} GiB; GitHub release assets must be < 2 GiB. "
                                   "Nothing was uploaded: shrink the wheel (fewer archs, strip debug info)")
            ra = assets.get(la.name)
            temp = assets.get(la.name + swap.TEMP)
            if ra is None and temp is not None and self.remote_sha256(temp, la, assets)[0] == la.sha256:
                uploads.append((la, temp, "finish"))  # an interrupted replacement: put it in place
                continue
            if ra is None:
                uploads.append((la, None, "upload"))
                continue
            sha, how = self.remote_sha256(ra, la, assets)
            if sha is None:
                uploads.append((la, ra, f"redo ({how})"))
            elif sha == la.sha256:
                self.summary.skipped.append(la.name)
                self.summary.plan.append(f"skip     {la.name} (same sha256: {how})")
            elif self.opts.replace:  # --replace-published alone only widens --prune, never replaces
                uploads.append((la, ra, "replace"))
                replacing.append((la, sha))
            else:
                conflicts.append(f"{la.name} ({how})")
        if conflicts:
            raise InputError(
                f"release {self.opts.tag} already holds different content under {len(conflicts)} name(s): "
                + ", ".join(conflicts[:10]) + (" …" if len(conflicts) > 10 else "")
                + ". Nothing was uploaded. A published wheel should not change: bump the version; "
                "or pass --replace to overwrite them"
            )
        published = release is not None and not release["draft"]
        if replacing and published and not self.opts.replace_published:
            names = [la.name for la, _ in replacing]
            raise InputError(
                f"release {self.opts.tag} is published: --replace would overwrite {len(names)} asset(s) users may "
                f"already have ({', '.join(names[:5])}{' …' if len(names) > 5 else ''}). Nothing was uploaded. "
                "Publish a new version instead, or add --replace-published to overwrite them anyway"
            )
        for la, old in replacing:
            self.summary.plan.append(f"replace  {la.name} on the {'published' if published else 'draft'} release "
                                     f"(remote {old if old.startswith('size:') else 'sha256:' + old[:12]}, "
                                     f"local sha256:{la.sha256[:12]})")
        local_names = {la.name for la in local}
        extras = sorted(n for n in assets if n not in local_names and n != SUMS and not swap.is_transient(n))
        if self.opts.prune and extras and published and not self.opts.replace_published:
            raise InputError(
                f"release {self.opts.tag} is published: --prune would delete {len(extras)} asset(s) users may "
                f"already have ({', '.join(extras[:5])}{' …' if len(extras) > 5 else ''}). Nothing was changed. "
                "Add --replace-published to delete them anyway"
            )
        final = len(local_names | {SUMS} | (set() if self.opts.prune else set(extras)))
        if final > MAX_ASSETS:
            raise InputError(
                f"release {self.opts.tag} would hold {final} assets; GitHub allows {MAX_ASSETS} per release. "
                f"Nothing was uploaded. Publish fewer targets per tag (each wheel costs 2 assets: wheel + record)"
                + ("" if self.opts.prune or not extras else f", or --prune the {len(extras)} assets not in this run")
            )
        for la, _, action in uploads:
            if action == "finish":
                self.summary.plan.append(f"finish   {la.name} (rename the replacement an interrupted run uploaded)")
            elif action != "replace":
                self.summary.plan.append(f"{action:<8} {la.name} ({la.size} bytes)")
        for n in extras:
            self.summary.plan.append(f"{'delete' if self.opts.prune else 'keep'}     {n} (on the release, not in {self.opts.wheels})")
        return uploads, extras

    # -- writing ---------------------------------------------------------------------------
    def ensure_release(self) -> dict:
        rel = self.find_release()
        if rel is not None:
            return rel
        repo = self.client.repo()

        def create() -> dict:
            self.throttle()
            kw = {}
            if self.opts.target_commitish:
                kw["target_commitish"] = self.opts.target_commitish
            r = repo.create_git_release(self.opts.tag, self.opts.name or self.opts.tag, self.notes(self.opts.notes),
                                        draft=True, prerelease=self.opts.prerelease, **kw)
            return _raw(r)
        rel = self._call(create, f"release {self.opts.tag}: create draft", before_retry=self.find_release)
        self.summary.created = True
        self.log(f"created draft release {self.opts.tag} (id {rel['id']})")
        return rel

    def _delete_asset(self, a: dict) -> None:
        from github import GithubException
        from github.GitReleaseAsset import GitReleaseAsset

        def go() -> bool:
            self.throttle()
            try:
                return self.client.gh().create_from_raw_data(GitReleaseAsset, a).delete_asset()
            except GithubException as e:
                if e.status == 404:  # already gone (an earlier attempt's answer was lost)
                    return True
                raise
        self._call(go, f"{a['name']}: delete")

    def _find_asset(self, release: dict, name: str) -> dict | None:
        return self.list_assets(release, f"{name}: look for it on the release").get(name)

    def upload(self, release: dict, la: LocalAsset, old: dict | None) -> dict:
        from github import GithubException

        if old is not None:  # a half-done upload (never a complete asset: see ci.release.publish.replace)
            self._delete_asset(old)

        def attempt() -> dict:
            self.throttle()
            rel = self.client.release(release)
            with la.open() as f:
                return _raw(rel.upload_asset_from_memory(f, la.size, la.name, content_type="application/octet-stream"))

        def reconcile() -> dict | None:
            """The upload may have landed although its answer was lost: look before re-sending."""
            cur = self._find_asset(release, la.name)
            if cur is None:
                return None
            sha, how = self.remote_sha256(cur, la, {la.name: cur})
            if sha is None:
                self._delete_asset(cur)  # a half-done upload
                return None
            if sha != la.sha256:
                raise PublishError(f"{la.name}: appeared on the release with other content ({how}) while uploading")
            return cur

        try:
            got = self._call(attempt, f"{la.name}: upload", before_retry=reconcile)
        except GithubException as e:
            if e.status != 422:
                raise
            got = reconcile()  # already_exists: someone (an earlier attempt) got there first
            if got is None:
                raise
        if got.get("size") != la.size or (got.get("digest") and got["digest"] != f"sha256:{la.sha256}"):
            self._delete_asset(got)
            raise PublishError(f"{la.name}: GitHub stored {got.get('size')} bytes / {got.get('digest')}, "
                               f"expected {la.size} / sha256:{la.sha256}; deleted it, re-run to retry")
        return got

    def put(self, release: dict, la: LocalAsset, old: dict | None, action: str, assets: dict[str, dict]) -> dict:
        """One asset onto the release: uploaded, put in place, or replaced (ci.release.publish.replace)."""
        if action == "replace":
            return swap.replace(self, release, la, old, assets)
        if action == "finish":
            return swap.finish(self, release, la, old)
        return self.upload(release, la, old)

    def _upload_all(self, release: dict, uploads: list[tuple[LocalAsset, dict | None, str]],
                    assets: dict[str, dict]) -> None:
        if not uploads:
            return
        with ThreadPoolExecutor(max_workers=max(1, self.opts.concurrency)) as pool:
            futures = {pool.submit(self.put, release, la, old, action, assets): (la, action)
                       for la, old, action in uploads}
            try:
                self._collect(futures)
            except BaseException:  # interrupted: start nothing new; a re-run resumes
                for f in futures:
                    f.cancel()
                raise

    def _collect(self, futures) -> None:
        for fut in as_completed(futures):
            la, action = futures[fut]
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - reported per asset
                t = classify(e)
                reason = str(e) if isinstance(e, PublishError) else f"{type(e).__name__}: {t or e}"
                self.summary.failed.append((la.name, reason))
                self.log(f"  {la.name}: FAILED: {reason}")
                continue
            replaced = action in ("replace", "finish")
            (self.summary.replaced if replaced else self.summary.uploaded).append(la.name)
            self.log(f"  {la.name}: {'replaced' if replaced else 'uploaded'}")

    def _sums_asset(self, local: list[LocalAsset], assets: dict[str, dict], extras: list[str]) -> LocalAsset:
        shas = {la.name: la.sha256 for la in local}
        for n in extras:
            if not self.opts.prune:
                sha, _ = self.remote_sha256(assets[n], None, assets)
                if sha:
                    shas[n] = sha
        return LocalAsset.from_bytes(SUMS, sums_text(shas), "sums")

    def validate(self) -> list[LocalAsset]:
        """Everything that can be refused without asking GitHub: repository, tag, wheels."""
        o = self.opts
        check_repo(o.repo)
        try:
            records = load_records(Path(o.wheels))
        except RecordError as e:
            raise InputError(str(e)) from None
        check_tag(o.tag, records)
        from ci.stages.provenance import ProvenanceError, check_for_release

        try:
            self.missing = check_for_release(records, o.build_outputs, o.plan, o.allow_local_build)
        except ProvenanceError as e:
            raise InputError(str(e)) from None
        if o.concurrency < 1:
            raise InputError(f"--concurrency {o.concurrency}: must be at least 1")
        return assets_of(Path(o.wheels), records)

    def run(self) -> Summary:
        o = self.opts
        local = self.validate()
        if not self.client.has_token:  # a dry run too: unauthenticated, it would not see drafts
            raise InputError(f"no GitHub token: set {' or '.join(TOKEN_VARS)} in the environment (a token with "
                             "contents: write on the repository; --dry-run reads the release with it, drafts included)")
        if o.dry_run:
            release = self.find_release()
            assets = self.list_assets(release) if release else {}
            self.summary.plan.append(f"{'reuse' if release else 'create'}   release {o.tag}"
                                     + (" (published)" if release and not release["draft"] else " (draft)"))
            uploads, extras = self.plan(local, release, assets)
            sums = self._sums_asset(local, assets, extras)
            self.summary.plan.append(f"{'skip' if self.sums_current(sums, assets) else 'write':<8} {SUMS}")
            if not release or release["draft"]:
                self.summary.plan.append(f"publish  release {o.tag} once every asset is verified")
            return self.summary

        release = self.ensure_release()
        self.summary.release_url = release.get("html_url", "")
        self.summary.already_published = not release["draft"]
        assets = self.list_assets(release)
        uploads, extras = self.plan(local, release, assets)
        if o.prune:
            for n in extras:
                self._delete_asset(assets[n])
                self.summary.deleted.append(n)
        else:
            self.summary.kept = list(extras)
        self._upload_all(release, uploads, assets)
        if self.summary.failed:
            raise PublishError(self.summary.line() + ". The release stays a draft" * (not self.summary.already_published)
                               + "; re-run the same command to finish (uploaded assets are kept)")

        # SHA256SUMS last: it vouches for assets that are all in place now.
        sums = self._sums_asset(local, assets, extras)
        cur, temp = assets.get(SUMS), assets.get(SUMS + swap.TEMP)
        if self.sums_current(sums, assets):
            self.summary.skipped.append(SUMS)
        elif cur is None and temp is not None and self.remote_sha256(temp, sums, assets)[0] == sums.sha256:
            swap.finish(self, release, sums, temp)
            self.summary.replaced.append(SUMS)
        else:
            live = cur is not None and cur.get("state") == "uploaded"
            self.put(release, sums, cur, "replace" if live else "upload", assets)
            (self.summary.replaced if cur is not None else self.summary.uploaded).append(SUMS)
            self.log(f"  {SUMS}: {'rewritten' if cur is not None else 'uploaded'}")
        if self.summary.replaced or any(swap.is_transient(n) for n in assets):
            self.summary.deleted += swap.clean_up(self, release)  # the retired assets, leftovers

        wrote = self.summary.uploaded or self.summary.replaced or self.summary.deleted
        self.verify(release, local + [sums], None if wrote else assets)
        if release["draft"] or self.notes(release.get("body") or "") != (release.get("body") or ""):
            self.publish(release)  # a published release only gets its notes brought up to date
        return self.summary

    def verify(self, release: dict, expected: list[LocalAsset], assets: dict[str, dict] | None = None) -> None:
        """Every expected asset present, uploaded, right size (and digest when given); with
        ``assets`` None the release is listed afresh (something was written)."""
        assets = self.list_assets(release) if assets is None else assets
        bad = []
        for la in expected:
            a = assets.get(la.name)
            if a is None or a.get("state") != "uploaded" or a.get("size") != la.size:
                bad.append(la.name)
            elif a.get("digest") and a["digest"] != f"sha256:{la.sha256}":
                bad.append(la.name)
        if bad:
            raise PublishError(f"release {self.opts.tag}: after uploading, {len(bad)} asset(s) are missing or differ: "
                               f"{', '.join(bad[:10])}; the release stays a draft; re-run to finish")

    def notes(self, body: str) -> str:
        """The release notes with the section naming missing targets (given a plan)."""
        return body if self.opts.plan is None else with_missing(body, self.missing)

    def publish(self, release: dict) -> None:
        def go() -> dict:
            self.throttle()
            rel = self.client.release(release)
            return _raw(rel.update_release(rel.name or self.opts.tag, self.notes(rel.body or ""), draft=False,
                                           prerelease=bool(rel.prerelease)))

        def landed() -> dict | None:
            cur = self.find_release()
            return cur if cur is not None and not cur["draft"] else None
        rel = self._call(go, f"release {self.opts.tag}: publish", before_retry=landed)
        self.summary.published = True
        self.summary.release_url = rel.get("html_url", self.summary.release_url)


def publish_release(opts: ReleaseOptions, token: str | None, log: Callable[[str], None] = default_log) -> Summary:
    """Create or reuse the release for ``opts.tag``, upload what is missing, publish. Raises
    PublishError (with the summary line) when something is left to do; re-running the same
    call finishes the job."""
    return ReleasePublisher(opts, token, log).run()
