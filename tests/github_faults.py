"""The GitHub stand-in (ci.release.github_standin) with faults, for the publisher's tests: a
subclass that plugs into the stand-in's hooks. Imported by the test modules (not a conftest: it
holds no fixtures pytest must discover).

Faults are injected per request (``inject``): the first fault, in the order injected, whose
method (any when None) and pattern (searched in the path and query; any when None) match a
request takes it, ``times`` times. The kinds: ``500``/``502``/``503``, ``403`` and ``429``
with ``Retry-After``, ``drop`` (close without answering, nothing applied), ``drop_after``
(apply, then close without answering: the client cannot know it worked), ``partial`` (an
upload that leaves a ``starter`` asset behind, then drops), ``slow`` (answer late),
``ratelimit`` (the primary limit spent: 403 with ``X-RateLimit-Remaining: 0`` and
``X-RateLimit-Reset`` ``retry_after`` seconds ahead, no ``Retry-After``). ``halt_after(n)``
stops the server as a crash would, once ``n`` more mutating requests have been applied: every
later request is dropped unanswered until ``resume()``."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from ci.release.github_standin import GitHubStandin

MUTATING = ("POST", "PATCH", "DELETE", "PUT")


@dataclass
class Fault:
    kind: str
    method: str | None = None
    path_re: str | None = None
    times: int = 1
    retry_after: int = 1
    delay: float = 0.0
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.times > 0 and (self.method is None or self.method == method)
                and (self.path_re is None or re.search(self.path_re, path) is not None))


def _drop(handler) -> bool:
    """Close the connection without answering (the request counted with status 0)."""
    handler.record(0)
    handler.close_connection = True
    try:
        handler.connection.shutdown(2)
    except OSError:
        pass
    return True


class FaultyGitHub(GitHubStandin):
    def __init__(self, token: str, **kw) -> None:
        super().__init__(token, **kw)
        self.faults: list[Fault] = []
        self.writes_left: int | None = None  # halt_after: mutating requests still applied

    def inject(self, kind: str, method: str | None = None, path_re: str | None = None, *, times: int = 1,
               retry_after: int = 1, delay: float = 0.0) -> Fault:
        f = Fault(kind, method, path_re, times, retry_after, delay)
        with self.lock:
            self.faults.append(f)
        return f

    def halt_after(self, n: int) -> None:
        with self.lock:
            self.writes_left = n

    def resume(self) -> None:
        with self.lock:
            self.writes_left = None

    @property
    def halted(self) -> bool:
        with self.lock:
            return self.writes_left is not None and self.writes_left <= 0

    # -- the stand-in's hooks --------------------------------------------------------------
    def before_request(self, handler, method: str, target: str) -> bool:
        """Take the request's fault (``handler.fault``, for the later hooks too), count it
        against ``halt_after``, and answer it here when the fault says so."""
        with self.lock:
            fault = next((f for f in self.faults if f.matches(method, target)), None)
            if fault:
                fault.times -= 1
                fault.hits += 1
            halted = self.writes_left is not None and self.writes_left <= 0
            if not halted and self.writes_left is not None and method in MUTATING:
                self.writes_left -= 1
        handler.fault = fault
        handler.partial = False
        if halted:
            return _drop(handler)
        kind = fault.kind if fault else None
        if kind == "slow":
            time.sleep(fault.delay)
            return False
        if kind in ("500", "502", "503"):
            handler.error(int(kind), "Server Error")
            return True
        if kind == "403":
            handler.send(403, {"message": "You have exceeded a secondary rate limit. Please wait a few minutes before you try again."},
                         {"Retry-After": str(fault.retry_after)})
            return True
        if kind == "ratelimit":
            handler.send(403, {"message": "API rate limit exceeded for installation."},
                         {"X-RateLimit-Limit": "1000", "X-RateLimit-Remaining": "0",
                          "X-RateLimit-Reset": str(int(time.time()) + fault.retry_after)})
            return True
        if kind == "429":
            handler.send(429, {"message": "Too Many Requests"}, {"Retry-After": str(fault.retry_after)})
            return True
        if kind == "drop":
            return _drop(handler)
        return False

    def upload_asset(self, handler, asset: dict) -> dict:
        """``partial``: half the bytes stored, the asset left in state ``starter``."""
        if handler.fault is None or handler.fault.kind != "partial":
            return asset
        handler.partial = True
        data = asset["_data"]
        return {**asset, "state": "starter", "size": len(data) // 2, "_data": data[: len(data) // 2]}

    def after_write(self, handler, status: int, payload=None, headers=None) -> bool:
        """``drop_after`` and a ``partial`` upload: applied, then the connection closed unanswered."""
        if handler.partial or (handler.fault is not None and handler.fault.kind == "drop_after"):
            return _drop(handler)
        return False
