"""What every publisher shares: the token from the environment, redaction of secrets from
everything printed or raised, retries that wait out rate limits (``Retry-After``,
``X-RateLimit-Reset``) and back off on failures within a wall-clock budget per request, and a
write throttle (GitHub asks for at least a second between mutating requests)."""

from __future__ import annotations

import email.utils
import http.client
import logging
import random
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, TypeVar
from ci.runtime import errors
from ci.runtime.errors import FactoryError
from ci.runtime.env import FactoryEnv
from ci.runtime.log import default_log

T = TypeVar("T")

TOKEN_VARS = ("GITHUB_TOKEN", "GH_TOKEN")


class PublishError(FactoryError, RuntimeError):
    """Publishing cannot go on; the message says why and what to do (never a secret)."""


class InputError(PublishError, errors.InputError):
    """What was asked is refused before anything is sent (a bad tag, repository, wheel or
    flag): the command line must change. Exit status 2."""


def check_api_url(url: str, option: str = "--api-url") -> str:
    """An http(s) URL with a host (GitHub's REST root), or InputError."""
    parts = urllib.parse.urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"{option} {url!r}: not an http(s) URL; expected GitHub's REST root, e.g. "
                         "https://api.github.com (GitHub Enterprise: https://HOST/api/v3)")
    return url


REPO_RE = re.compile(r"^(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]{0,38}))/(?P<name>[A-Za-z0-9._-]{1,100})$")


def check_repo(repo: str) -> str:
    """``OWNER/NAME`` as GitHub spells repositories, or InputError."""
    m = REPO_RE.match(repo or "")
    if m is None or m["name"] in (".", ".."):
        raise InputError(f"--repo {repo!r}: not a GitHub repository; expected OWNER/NAME (e.g. octo/sageattn3)")
    return repo


class LineLog:
    """A log function safe to call from several threads: each message is written whole, as
    its own line(s), never interleaved with another thread's."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        with self._lock:
            self._write(msg)


class Redactor:
    """Replaces every known secret by ``***`` in text; also a logging filter."""

    def __init__(self, secrets: list[str] | None = None) -> None:
        self.secrets = [s for s in (secrets or []) if s and len(s) >= 4]

    @classmethod
    def from_env(cls) -> "Redactor":
        names = [*TOKEN_VARS, "TWINE_PASSWORD", "TWINE_USERNAME"]
        # stripped as token_from_env strips them: the value sent (and maybe echoed) is the stripped one
        values = _secrets()
        return cls([values[n] for n in names if n != "TWINE_USERNAME" or values[n] != "__token__"])

    def __call__(self, text: object) -> str:
        s = str(text)
        for secret in self.secrets:
            s = s.replace(secret, "***")
        return s

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self(record.getMessage())
        record.args = ()
        return True

    def install(self) -> None:
        """Redact in every log record of this process (PyGithub, urllib3, twine…)."""
        root = logging.getLogger()
        root.addFilter(self)
        for h in root.handlers:
            h.addFilter(self)


def _secrets() -> dict[str, str]:
    """The secrets publishing may send, by variable, stripped (empty: unset)."""
    env = FactoryEnv.from_environ()
    return {"GITHUB_TOKEN": env.github_token, "GH_TOKEN": env.gh_token,
            "TWINE_PASSWORD": (env.twine_password or "").strip(), "TWINE_USERNAME": (env.twine_username or "").strip()}


def token_from_env(required: bool = True) -> str | None:
    for name in TOKEN_VARS:
        value = _secrets()[name]
        if value:
            return value
    if required:
        raise PublishError(f"no GitHub token: set {' or '.join(TOKEN_VARS)} in the environment "
                           "(a token with contents: write on the repository)")
    return None


@dataclass(frozen=True)
class RetryPolicy:
    """How long one request keeps trying. Rate limits are waited out as the server asks
    (``Retry-After``; ``X-RateLimit-Reset`` when the primary limit is spent), other transient
    failures (5xx, dropped connections) back off exponentially; either way a request gives up
    once waiting again would take it past ``budget`` seconds of wall-clock time since its
    first attempt, or when one wait asked for exceeds ``max_wait``. ``attempts`` (None: no
    count) is an extra cap. ``clock``/``sleep``/``now`` are injectable for tests."""

    attempts: int | None = None
    backoff: float = 1.0  # first wait; doubles each attempt, with jitter
    max_backoff: float = 60.0
    max_wait: float = 600.0  # the longest Retry-After / rate-limit reset we accept to sleep
    budget: float = 900.0  # wall-clock seconds one request may spend, waits included
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    now: Callable[[], float] = time.time  # epoch seconds, what X-RateLimit-Reset is measured in

    def delay(self, attempt: int) -> float:
        d = min(self.backoff * (2 ** attempt), self.max_backoff)
        return d * (0.5 + random.random() / 2)


class Transient(Exception):
    """A failure worth retrying; ``wait`` is what the server asked for, if anything."""

    def __init__(self, what: str, wait: float | None = None) -> None:
        super().__init__(what)
        self.wait = wait


def _header(headers: dict | None, name: str) -> str | None:
    for k, v in (headers or {}).items():
        if k.lower() == name.lower():
            return str(v)
    return None


def retry_after_seconds(headers: dict | None, now: Callable[[], float] = time.time) -> float | None:
    v = _header(headers, "Retry-After")
    if v is None:
        return None
    try:
        return max(float(v), 0.0)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(v)
        except (TypeError, ValueError):
            return None
        return max(when.timestamp() - now(), 0.0)


def classify(exc: BaseException, now: Callable[[], float] = time.time) -> Transient | None:
    """A Transient for errors worth retrying (5xx, 403/429 rate limits, dropped or timed-out
    connections), None for the rest."""
    from github import GithubException

    if isinstance(exc, Transient):
        return exc
    if isinstance(exc, GithubException):
        status, headers = exc.status, exc.headers or {}
        wait = retry_after_seconds(headers, now)
        if status in (403, 429):
            remaining = _header(headers, "X-RateLimit-Remaining")
            message = str(getattr(exc, "data", "") or "").lower()
            if wait is None and remaining == "0":
                reset = _header(headers, "X-RateLimit-Reset")
                try:
                    wait = max(float(reset) - now(), 0.0) + 1 if reset else None
                except ValueError:
                    wait = None
            if wait is not None or "rate limit" in message or status == 429:
                return Transient(f"HTTP {status} rate limited", wait)
            return None
        if status >= 500:
            return Transient(f"HTTP {status}", wait)
        return None
    try:
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return Transient(f"connection: {type(exc).__name__}")
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, (ConnectionError, TimeoutError, http.client.HTTPException)):
        return Transient(f"connection: {type(exc).__name__}")
    return None


def refusal(exc: BaseException, what: str) -> PublishError | None:
    """A PublishError saying what to check, for an answer that no retry can change: 401 (the
    token), 404 (the repository, or the token cannot see it), a 403 that is not a rate limit
    (the token's permissions). None for anything else."""
    from github import GithubException

    if not isinstance(exc, GithubException) or exc.status not in (401, 403, 404):
        return None
    data = exc.data if isinstance(exc.data, dict) else {}
    said = str(data.get("message") or "").strip()
    said = f" ({said})" if said else ""
    vars_ = " or ".join(TOKEN_VARS)
    if exc.status == 401:
        why = (f"the token in {vars_} was refused: it is wrong, expired or revoked; set a valid token "
               "(one with contents: write on the repository)")
    elif exc.status == 403:
        why = ("the token may not do this: it needs contents: write on the repository (a fine-grained token "
               "must also include this repository; in a workflow, `permissions: contents: write`)")
    else:
        why = ("not found: check that --repo names an existing repository, and that the token can see it "
               "(GitHub answers 404, not 403, for a private repository the token has no access to)")
    return PublishError(f"{what}: HTTP {exc.status}{said}: {why}")


def retrying(fn: Callable[[], T], what: str, policy: RetryPolicy, *, log: Callable[[str], None] = default_log,
             before_retry: Callable[[], T | None] | None = None, sleep: Callable[[float], None] | None = None) -> T:
    """Call ``fn`` until it succeeds, waiting out rate limits and backing off on transient
    failures within ``policy.budget`` seconds (see RetryPolicy). ``before_retry`` runs before
    each retry and may return a result that ends the loop (the write landed although its answer
    was lost)."""
    sleep = sleep or policy.sleep
    start = policy.clock()
    attempt = 0
    while True:
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - classified below
            t = classify(e, policy.now)
            if t is None:
                r = refusal(e, what)
                if r is not None:
                    raise r from None
                raise
            attempt += 1
            if policy.attempts is not None and attempt >= policy.attempts:
                raise PublishError(f"{what}: still failing after {attempt} attempts ({t})") from None
            wait = t.wait if t.wait is not None else policy.delay(attempt - 1)
            if wait > policy.max_wait:
                raise PublishError(f"{what}: the server asks to wait {wait:.0f}s (more than {policy.max_wait:.0f}s, "
                                   "--max-wait); re-run later: the publish resumes where it stopped") from None
            spent = policy.clock() - start
            if spent + wait > policy.budget:
                raise PublishError(f"{what}: still failing after {attempt} attempts in {spent:.0f}s ({t}); waiting "
                                   f"{wait:.0f}s more would pass the retry budget of {policy.budget:.0f}s "
                                   "(--retry-budget): re-run later, the publish resumes where it stopped") from None
            count = f"{attempt}/{policy.attempts - 1}" if policy.attempts is not None else f"{attempt}"
            log(f"  {what}: retry {count} in {wait:.1f}s ({t}; {policy.budget - spent:.0f}s of the retry budget left)")
            sleep(wait)
            if before_retry is not None:
                done = before_retry()
                if done is not None:
                    return done


class Throttle:
    """At least ``interval`` seconds between the starts of mutating requests, across threads."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        if self.interval <= 0:
            return
        with self._lock:
            now = time.monotonic()
            wait = self._next - now
            self._next = max(now, self._next) + self.interval
        if wait > 0:
            time.sleep(wait)
