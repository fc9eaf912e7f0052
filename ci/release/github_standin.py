"""A loopback HTTP server that speaks the part of GitHub's documented REST contract that the
publisher uses (the contract: ci.release.github_rest). The release dry run (``python -m
ci.release dry-run``) publishes to it, as it resolves torch against the stand-in for PyTorch's
index (ci.release.standin): GitHub itself is not reachable from where the rehearsal runs.

It answers every request as GitHub would. A subclass changes that through three hooks, which do
nothing here: ``before_request`` (every request), ``after_write`` (a request that changed the
state, before its answer) and ``upload_asset`` (what an upload stores); the publisher's tests
make it fail on purpose that way (tests/)."""

from __future__ import annotations

import hashlib
import re
import threading
import urllib.parse
from http.server import ThreadingHTTPServer

from ci.release.github_rest import Logged, Repo, _Handler


class GitHubStandin:
    def __init__(self, token: str, *, digests: bool = True, per_page_max: int = 100) -> None:
        self.token = token
        self.digests = digests
        self.per_page_max = per_page_max
        self.repos: dict[str, Repo] = {}
        self.requests: list[Logged] = []
        self.lock = threading.RLock()
        self._ids = iter(range(1000, 10**9))
        handler = type("Handler", (_Handler,), {"gh": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.root}/api/v3"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    # -- control -------------------------------------------------------------------------
    def __enter__(self) -> "GitHubStandin":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_repo(self, full: str) -> Repo:
        owner, name = full.split("/")
        with self.lock:
            return self.repos.setdefault(full, Repo(owner, name))

    def count(self, method: str | None = None, path_re: str | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.requests if (method is None or r.method == method)
                       and (path_re is None or re.search(path_re, r.path)))

    def uploads(self) -> int:
        return self.count("POST", r"^/api/uploads/")

    def release_by_tag(self, full: str, tag: str) -> list[dict]:
        with self.lock:
            return [r for r in self.repos[full].releases.values() if r["tag_name"] == tag]

    def asset_files(self, full: str, release_id: int) -> dict[str, bytes]:
        with self.lock:
            out: dict[str, bytes] = {}
            for a in self.repos[full].assets.values():
                if a["_release"] == release_id:
                    assert a["name"] not in out, f"duplicate asset name {a['name']}"
                    out[a["name"]] = a["_data"]
            return out

    def branch_files(self, full: str, branch: str) -> dict[str, bytes]:
        repo = self.repos[full]
        commit = repo.objects[repo.refs[f"refs/heads/{branch}"]][1]
        return {p: repo.objects[s][1] for p, (_, s) in self._flatten(repo, commit["tree"]).items()}

    def next_id(self) -> int:
        return next(self._ids)

    # -- hooks: what a subclass overrides (request thread; the last two under lock) ------
    def before_request(self, handler: _Handler, method: str, target: str) -> bool:
        """Every request, once its body is read, before authentication and routing (``target``:
        the path and query as sent). True when the hook answered the request itself
        (``handler.send``, ``handler.error``) or left it unanswered (``handler.record(0)``, the
        connection closed): nothing more is done with it. Here: False."""
        return False

    def after_write(self, handler: _Handler, status: int, payload=None, headers: dict[str, str] | None = None) -> bool:
        """A request that changed the state (created, updated, deleted, uploaded), before its
        answer (``status``, ``payload``, ``headers``) is sent. True when the hook answered it
        itself or left it unanswered. Here: False."""
        return False

    def upload_asset(self, handler: _Handler, asset: dict) -> dict:
        """What an upload stores: the asset's JSON fields and ``_data`` (the bytes received).
        Here: ``asset`` as it is."""
        return asset

    # -- json shapes ---------------------------------------------------------------------
    def _release_json(self, repo: Repo, rel: dict) -> dict:
        base = f"{self.api_url}/repos/{repo.owner}/{repo.name}"
        rid = rel["id"]
        assets = [self._asset_json(repo, a) for a in sorted(repo.assets.values(), key=lambda a: a["id"])
                  if a["_release"] == rid]
        return {
            "url": f"{base}/releases/{rid}", "id": rid, "node_id": f"RE_{rid}",
            "html_url": f"{self.root}/{repo.owner}/{repo.name}/releases/tag/{rel['tag_name']}",
            "assets_url": f"{base}/releases/{rid}/assets",
            "upload_url": f"{self.root}/api/uploads/repos/{repo.owner}/{repo.name}/releases/{rid}/assets{{?name,label}}",
            "tarball_url": None, "zipball_url": None,
            "tag_name": rel["tag_name"], "target_commitish": rel["target_commitish"], "name": rel["name"],
            "body": rel["body"], "draft": rel["draft"], "prerelease": rel["prerelease"],
            "created_at": rel["created_at"], "published_at": rel["published_at"],
            "author": {"login": "bot", "id": 1}, "assets": assets,
        }

    def _asset_json(self, repo: Repo, a: dict) -> dict:
        d = {k: v for k, v in a.items() if not k.startswith("_")}
        d["url"] = f"{self.api_url}/repos/{repo.owner}/{repo.name}/releases/assets/{a['id']}"
        d["browser_download_url"] = f"{self.root}/download/{a['id']}/{urllib.parse.quote(a['name'])}"
        if self.digests and a["state"] == "uploaded":
            d["digest"] = "sha256:" + hashlib.sha256(a["_data"]).hexdigest()
        return d

    # -- git objects ---------------------------------------------------------------------
    def _store(self, repo: Repo, kind: str, payload, raw: bytes) -> str:
        sha = hashlib.sha1(f"{kind} {len(raw)}\0".encode() + raw).hexdigest()
        repo.objects[sha] = (kind, payload)
        return sha

    def _put_tree(self, repo: Repo, entries: dict[str, tuple[str, str, str]]) -> str:
        """entries: name -> (mode, type, sha); returns the tree's sha (git's real format)."""
        def key(n: str) -> str:
            return n + "/" if entries[n][1] == "tree" else n
        raw = b"".join(f"{entries[n][0]} {n}\0".encode() + bytes.fromhex(entries[n][2]) for n in sorted(entries, key=key))
        return self._store(repo, "tree", dict(entries), raw)

    def _flatten(self, repo: Repo, tree_sha: str, prefix: str = "") -> dict[str, tuple[str, str]]:
        out: dict[str, tuple[str, str]] = {}
        for name, (mode, typ, sha) in repo.objects[tree_sha][1].items():
            if typ == "tree":
                out.update(self._flatten(repo, sha, prefix + name + "/"))
            else:
                out[prefix + name] = (mode, sha)
        return out

    def _build_tree(self, repo: Repo, files: dict[str, tuple[str, str]]) -> str:
        top: dict[str, tuple[str, str, str]] = {}
        subdirs: dict[str, dict[str, tuple[str, str]]] = {}
        for path, (mode, sha) in files.items():
            head, _, rest = path.partition("/")
            if rest:
                subdirs.setdefault(head, {})[rest] = (mode, sha)
            else:
                top[head] = (mode, "blob", sha)
        for d, sub in subdirs.items():
            top[d] = ("040000", "tree", self._build_tree(repo, sub))
        return self._put_tree(repo, top)
