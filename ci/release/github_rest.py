"""The request handler of the GitHub stand-in (ci.release.github_standin): the part of GitHub's
documented REST contract that the publisher uses, laid out like GitHub Enterprise Server: the API under ``/api/v3`` and the
uploads host under ``/api/uploads`` (a release's ``upload_url`` is a hypermedia template
pointing there). Written from docs.github.com (REST: releases, release assets, git
database, pagination):

- releases: list (newest first, ``per_page``/``page`` with ``Link`` headers), create (201;
  422 when a published release has the tag), get, get by tag (published releases only, as
  documented), update (``draft: false`` publishes and creates the tag), delete;
- assets: list (paginated), upload (``POST {upload_url}?name=&label=``; 201; 422
  ``already_exists`` on a duplicate name), get (JSON, or ``Accept: application/octet-stream``
  -> 302 to the download), update (``PATCH``: ``name``, ``label``; 422 ``already_exists`` when
  another asset of the release has the name), delete (204); assets carry ``digest: "sha256:..."`` unless the
  server is started with ``digests=False`` (older API versions / GHES);
- git database: blobs, trees (with ``base_tree``, nested paths, deletion by ``sha: null``,
  ``recursive``), commits, refs (get, create, update with fast-forward check), with real git
  object ids for blobs;
- authentication: ``Authorization: token|Bearer <token>`` must match, else 401.

Every request is counted (``requests``). A subclass of the server changes what it does through
three hooks (ci.release.github_standin): ``before_request`` (every request, before
authentication and routing), ``after_write`` (a request that changed the state, before its
answer) and ``upload_asset`` (what an upload stores). A hook answers through the handler:
``send``, ``error``, or ``record`` for a request it leaves unanswered."""

from __future__ import annotations

import hashlib
import json
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ci.release.github_standin import GitHubStandin


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Logged:
    method: str
    path: str
    status: int
    auth: str | None


@dataclass
class Repo:
    owner: str
    name: str
    releases: dict[int, dict] = field(default_factory=dict)
    assets: dict[int, dict] = field(default_factory=dict)  # id -> asset json (+ "_data")
    tags: set[str] = field(default_factory=set)
    objects: dict[str, tuple[str, object]] = field(default_factory=dict)  # sha -> (type, payload)
    refs: dict[str, str] = field(default_factory=dict)  # "refs/heads/gh-pages" -> commit sha


class _Handler(BaseHTTPRequestHandler):
    gh: GitHubStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:
        pass

    # -- plumbing (send, error, record: what the server's hooks answer with) -------------
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def send(self, status: int, payload=None, headers: dict[str, str] | None = None, raw: bytes | None = None) -> None:
        """Answer: ``payload`` as JSON (or ``raw`` bytes), with ``headers``; the request recorded first."""
        data = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
        self.record(status)  # before answering: a client that got its answer finds it counted
        self.send_response(status)
        if raw is None and payload is not None:
            self.send_header("Content-Type", "application/json; charset=utf-8")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data and self.command != "HEAD":
            self.wfile.write(data)
        self._status = status

    def error(self, status: int, message: str, **extra) -> None:
        """Answer with GitHub's error body."""
        self.send(status, {"message": message, "documentation_url": "https://docs.github.com/rest", **extra})

    def record(self, status: int) -> None:
        """Count the request in ``requests`` with ``status`` (0: left unanswered), once."""
        if not self._logged:
            self._logged = True
            with self.gh.lock:
                self.gh.requests.append(Logged(self.command, urllib.parse.urlsplit(self.path).path, status,
                                               self.headers.get("Authorization")))

    def _handle(self) -> None:
        gh = self.gh
        self._status = 0
        self._logged = False
        parsed = urllib.parse.urlsplit(self.path)
        path, query = parsed.path, urllib.parse.parse_qs(parsed.query)
        auth = self.headers.get("Authorization")
        body = self._body()
        try:
            if gh.before_request(self, self.command, self.path):  # path and query
                return
            if not path.startswith("/download/"):
                token = (auth or "").split(" ", 1)[-1]
                if not auth or token != gh.token:
                    return self.error(401, "Bad credentials")
            self._route(path, query, body)
        finally:
            self.record(self._status)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = do_HEAD = _handle

    def _applied(self, status: int, payload=None, headers=None) -> None:
        """The answer to a request that changed the state, unless ``after_write`` gave it."""
        if not self.gh.after_write(self, status, payload, headers):
            self.send(status, payload, headers)

    def _paginate(self, items: list, query: dict, base: str) -> None:
        per_page = min(int(query.get("per_page", ["30"])[0]), self.gh.per_page_max)
        page = max(int(query.get("page", ["1"])[0]), 1)
        last = max((len(items) + per_page - 1) // per_page, 1)
        chunk = items[(page - 1) * per_page: page * per_page]
        links = []
        url = lambda p: f"<{self.gh.root}{base}?per_page={per_page}&page={p}>"  # noqa: E731
        if page < last:
            links += [f'{url(page + 1)}; rel="next"', f'{url(last)}; rel="last"']
        if page > 1:
            links += [f'{url(1)}; rel="first"', f'{url(page - 1)}; rel="prev"']
        self.send(200, chunk, {"Link": ", ".join(links)} if links else None)

    # -- routes --------------------------------------------------------------------------
    def _route(self, path: str, query: dict, body: bytes) -> None:
        gh = self.gh
        m = re.match(r"^/download/(\d+)/", path)
        if m:
            with gh.lock:
                a = next((a for r in gh.repos.values() for a in r.assets.values() if a["id"] == int(m[1])), None)
            if not a:
                return self.error(404, "Not Found")
            return self.send(200, raw=a["_data"], headers={"Content-Type": "application/octet-stream"})
        m = re.match(r"^/api/(v3|uploads)/repos/([^/]+)/([^/]+)(/.*)?$", path)
        if not m:
            return self.error(404, "Not Found")
        full = f"{m[2]}/{m[3]}"
        with gh.lock:
            repo = gh.repos.get(full)
        if repo is None:
            return self.error(404, "Not Found")
        rest = m[4] or ""
        base = f"/api/v3/repos/{full}"
        v = self.command
        with gh.lock:
            if m[1] == "uploads":
                mm = re.match(r"^/releases/(\d+)/assets$", rest)
                if v != "POST" or not mm:
                    return self.error(404, "Not Found")
                return self._upload(repo, int(mm[1]), query, body)
            if rest == "" and v == "GET":
                return self.send(200, {"id": 1, "name": repo.name, "full_name": full, "owner": {"login": repo.owner},
                                       "url": f"{gh.api_url}/repos/{full}", "default_branch": "main", "private": False})
            if rest == "/releases" and v == "GET":
                rels = sorted(repo.releases.values(), key=lambda r: r["id"], reverse=True)
                return self._paginate([gh._release_json(repo, r) for r in rels], query, base + "/releases")
            if rest == "/releases" and v == "POST":
                return self._create_release(repo, body)
            mm = re.match(r"^/releases/tags/(.+)$", rest)
            if mm and v == "GET":
                tag = urllib.parse.unquote(mm[1])
                rel = next((r for r in repo.releases.values() if r["tag_name"] == tag and not r["draft"]), None)
                return self.send(200, gh._release_json(repo, rel)) if rel else self.error(404, "Not Found")
            mm = re.match(r"^/releases/assets/(\d+)$", rest)
            if mm:
                return self._asset(repo, int(mm[1]), body)
            mm = re.match(r"^/releases/(\d+)(/assets)?$", rest)
            if mm:
                return self._release(repo, int(mm[1]), bool(mm[2]), query, body, base)
            if rest.startswith("/git/"):
                return self._git(repo, rest[len("/git"):], query, body)
        return self.error(404, "Not Found")

    def _create_release(self, repo: Repo, body: bytes) -> None:
        """POST /releases: a draft or published release; 422 for a missing or published tag."""
        gh = self.gh
        d = json.loads(body or b"{}")
        tag = d.get("tag_name")
        if not tag:
            return self.error(422, "Validation Failed", errors=[{"resource": "Release", "code": "missing_field", "field": "tag_name"}])
        if any(r["tag_name"] == tag and not r["draft"] for r in repo.releases.values()):
            return self.error(422, "Validation Failed", errors=[{"resource": "Release", "code": "already_exists", "field": "tag_name"}])
        rid = gh.next_id()
        rel = {"id": rid, "tag_name": tag, "target_commitish": d.get("target_commitish") or "main",
               "name": d.get("name") or tag, "body": d.get("body") or "", "draft": bool(d.get("draft")),
               "prerelease": bool(d.get("prerelease")), "created_at": _now(), "published_at": None}
        if not rel["draft"]:
            rel["published_at"] = _now()
            repo.tags.add(tag)
        repo.releases[rid] = rel
        return self._applied(201, gh._release_json(repo, rel))

    def _asset(self, repo: Repo, aid: int, body: bytes) -> None:
        """GET (JSON, or the download's redirect), DELETE and PATCH (rename, label) of one asset."""
        gh, v = self.gh, self.command
        a = repo.assets.get(aid)
        if a is None:
            return self.error(404, "Not Found")
        if v == "GET":
            if "application/octet-stream" in (self.headers.get("Accept") or ""):
                return self.send(302, None, {"Location": gh._asset_json(repo, a)["browser_download_url"]})
            return self.send(200, gh._asset_json(repo, a))
        if v == "DELETE":
            del repo.assets[a["id"]]
            return self._applied(204)
        if v == "PATCH":
            d = json.loads(body or b"{}")
            name = d.get("name", a["name"])
            if any(o["name"] == name and o["_release"] == a["_release"] and o["id"] != a["id"]
                   for o in repo.assets.values()):
                return self.error(422, "Validation Failed",
                                  errors=[{"resource": "ReleaseAsset", "code": "already_exists", "field": "name"}])
            a["name"] = name
            if "label" in d:
                a["label"] = d["label"] or None
            a["updated_at"] = _now()
            return self._applied(200, gh._asset_json(repo, a))
        return self.error(404, "Not Found")

    def _release(self, repo: Repo, rid: int, assets: bool, query: dict, body: bytes, base: str) -> None:
        """GET, PATCH (publishing a draft) and DELETE of one release; GET of its assets, paginated."""
        gh, v = self.gh, self.command
        rel = repo.releases.get(rid)
        if rel is None:
            return self.error(404, "Not Found")
        if assets and v == "GET":
            listed = [gh._asset_json(repo, a) for a in sorted(repo.assets.values(), key=lambda a: a["id"])
                      if a["_release"] == rel["id"]]
            return self._paginate(listed, query, f"{base}/releases/{rel['id']}/assets")
        if assets:
            return self.error(404, "Not Found")
        if v == "GET":
            return self.send(200, gh._release_json(repo, rel))
        if v == "PATCH":
            d = json.loads(body or b"{}")
            for k in ("tag_name", "name", "body", "prerelease", "target_commitish"):
                if k in d:
                    rel[k] = d[k]
            if "draft" in d and rel["draft"] and not d["draft"]:
                if any(r["tag_name"] == rel["tag_name"] and not r["draft"] and r["id"] != rel["id"]
                       for r in repo.releases.values()):
                    return self.error(422, "Validation Failed", errors=[{"resource": "Release", "code": "already_exists", "field": "tag_name"}])
                rel["draft"] = False
                rel["published_at"] = _now()
                repo.tags.add(rel["tag_name"])
            return self._applied(200, gh._release_json(repo, rel))
        if v == "DELETE":
            del repo.releases[rel["id"]]
            for aid in [i for i, a in repo.assets.items() if a["_release"] == rel["id"]]:
                del repo.assets[aid]
            return self._applied(204)
        return self.error(404, "Not Found")

    def _upload(self, repo: Repo, rid: int, query: dict, body: bytes) -> None:
        gh = self.gh
        if rid not in repo.releases:
            return self.error(404, "Not Found")
        name = (query.get("name") or [""])[0]
        if not name:
            return self.error(422, "Validation Failed", errors=[{"resource": "ReleaseAsset", "code": "missing_field", "field": "name"}])
        if any(a["name"] == name and a["_release"] == rid for a in repo.assets.values()):
            return self.error(422, "Validation Failed", errors=[{"resource": "ReleaseAsset", "code": "already_exists", "field": "name"}])
        if len(body) != int(self.headers.get("Content-Length") or 0):
            return self.error(400, "Bad Content-Length")
        aid = gh.next_id()
        a = {"id": aid, "node_id": f"RA_{aid}", "name": name, "label": (query.get("label") or [""])[0] or None,
             "content_type": self.headers.get("Content-Type") or "application/octet-stream",
             "state": "uploaded", "size": len(body), "download_count": 0, "created_at": _now(), "updated_at": _now(),
             "uploader": {"login": "bot", "id": 1}, "_release": rid, "_data": body}
        a = gh.upload_asset(self, a)
        repo.assets[aid] = a
        return self._applied(201, gh._asset_json(repo, a))

    def _git(self, repo: Repo, rest: str, query: dict, body: bytes) -> None:
        gh = self.gh
        v = self.command
        d = json.loads(body or b"{}") if v in ("POST", "PATCH") else {}
        url = f"{gh.api_url}/repos/{repo.owner}/{repo.name}/git"
        if rest == "/blobs" and v == "POST":
            import base64
            data = base64.b64decode(d["content"]) if d.get("encoding") == "base64" else d["content"].encode()
            sha = gh._store(repo, "blob", data, data)
            return self._applied(201, {"sha": sha, "url": f"{url}/blobs/{sha}"})
        mm = re.match(r"^/blobs/([0-9a-f]{40})$", rest)
        if mm and v == "GET":
            import base64
            o = repo.objects.get(mm[1])
            if not o or o[0] != "blob":
                return self.error(404, "Not Found")
            return self.send(200, {"sha": mm[1], "size": len(o[1]), "encoding": "base64", "url": f"{url}/blobs/{mm[1]}",
                                   "content": base64.b64encode(o[1]).decode()})
        if rest == "/trees" and v == "POST":
            files: dict[str, tuple[str, str]] = {}
            if d.get("base_tree"):
                if d["base_tree"] not in repo.objects:
                    return self.error(422, "Invalid tree info")
                files = gh._flatten(repo, d["base_tree"])
            for e in d.get("tree", []):
                p = e["path"]
                if e.get("sha", "x") is None:
                    files = {k: val for k, val in files.items() if k != p and not k.startswith(p + "/")}
                    continue
                if "content" in e:
                    raw = e["content"].encode()
                    sha = gh._store(repo, "blob", raw, raw)
                else:
                    sha = e["sha"]
                    if sha not in repo.objects:
                        return self.error(422, "Invalid tree info", errors=[f"{p}: object {sha} not found"])
                files[p] = (e.get("mode", "100644"), sha)
            sha = gh._build_tree(repo, files)
            return self._applied(201, self._tree_json(repo, sha, recursive=False))
        mm = re.match(r"^/trees/([0-9a-f]{40})$", rest)
        if mm and v == "GET":
            if mm[1] not in repo.objects:
                return self.error(404, "Not Found")
            return self.send(200, self._tree_json(repo, mm[1], recursive=query.get("recursive", ["0"])[0] not in ("0", "false")))
        if rest == "/commits" and v == "POST":
            if d["tree"] not in repo.objects:
                return self.error(422, "Tree SHA does not exist")
            c = {"tree": d["tree"], "parents": list(d.get("parents", [])), "message": d["message"]}
            raw = json.dumps(c, sort_keys=True).encode() + _now().encode()
            sha = gh._store(repo, "commit", c, raw)
            return self._applied(201, self._commit_json(repo, sha))
        mm = re.match(r"^/commits/([0-9a-f]{40})$", rest)
        if mm and v == "GET":
            if mm[1] not in repo.objects:
                return self.error(404, "Not Found")
            return self.send(200, self._commit_json(repo, mm[1]))
        mm = re.match(r"^/ref/(.+)$", rest)
        if mm and v == "GET":
            ref = "refs/" + urllib.parse.unquote(mm[1])
            if ref not in repo.refs:
                return self.error(404, "Not Found")
            return self.send(200, self._ref_json(repo, ref))
        if rest == "/refs" and v == "POST":
            ref = d["ref"]
            if ref in repo.refs:
                return self.error(422, "Reference already exists")
            if d["sha"] not in repo.objects:
                return self.error(422, "Object does not exist")
            repo.refs[ref] = d["sha"]
            return self._applied(201, self._ref_json(repo, ref))
        mm = re.match(r"^/refs/(.+)$", rest)
        if mm and v == "PATCH":
            ref = "refs/" + urllib.parse.unquote(mm[1])
            if ref not in repo.refs:
                return self.error(422, "Reference does not exist")
            new = d["sha"]
            if not d.get("force") and not self._descends(repo, new, repo.refs[ref]):
                return self.error(422, "Update is not a fast forward")
            repo.refs[ref] = new
            return self._applied(200, self._ref_json(repo, ref))
        return self.error(404, "Not Found")

    def _descends(self, repo: Repo, sha: str, ancestor: str) -> bool:
        todo = [sha]
        while todo:
            s = todo.pop()
            if s == ancestor:
                return True
            o = repo.objects.get(s)
            if o and o[0] == "commit":
                todo += o[1]["parents"]
        return False

    def _tree_json(self, repo: Repo, sha: str, recursive: bool) -> dict:
        url = f"{self.gh.api_url}/repos/{repo.owner}/{repo.name}/git"
        entries = []
        if recursive:
            def walk(tsha: str, prefix: str) -> None:
                for name, (mode, typ, s) in sorted(repo.objects[tsha][1].items()):
                    entries.append({"path": prefix + name, "mode": mode, "type": typ, "sha": s,
                                    "url": f"{url}/{typ}s/{s}", **({"size": len(repo.objects[s][1])} if typ == "blob" else {})})
                    if typ == "tree":
                        walk(s, prefix + name + "/")
            walk(sha, "")
        else:
            for name, (mode, typ, s) in sorted(repo.objects[sha][1].items()):
                entries.append({"path": name, "mode": mode, "type": typ, "sha": s, "url": f"{url}/{typ}s/{s}"})
        return {"sha": sha, "url": f"{url}/trees/{sha}", "tree": entries, "truncated": False}

    def _commit_json(self, repo: Repo, sha: str) -> dict:
        url = f"{self.gh.api_url}/repos/{repo.owner}/{repo.name}/git"
        c = repo.objects[sha][1]
        who = {"name": "bot", "email": "bot@example.invalid", "date": _now()}
        return {"sha": sha, "url": f"{url}/commits/{sha}", "message": c["message"], "author": who, "committer": who,
                "tree": {"sha": c["tree"], "url": f"{url}/trees/{c['tree']}"},
                "parents": [{"sha": p, "url": f"{url}/commits/{p}"} for p in c["parents"]]}

    def _ref_json(self, repo: Repo, ref: str) -> dict:
        url = f"{self.gh.api_url}/repos/{repo.owner}/{repo.name}/git"
        sha = repo.refs[ref]
        return {"ref": ref, "url": f"{url}/{ref}", "object": {"type": "commit", "sha": sha, "url": f"{url}/commits/{sha}"}}

