"""Rate limits waited out by time, not counted: the 8-wheel publish against the loopback GitHub
stand-in under harsh faults (secondary limits with ``Retry-After``, the primary limit spent
with ``X-RateLimit-Reset``, 429s, 5xx, dropped connections, lost answers) converges with the
default RetryPolicy; a request gives up only past its wall-clock budget. The clock is virtual
(each thread's own, as parallel waits overlap in real time): the waits the server asks for are
minutes, the test takes seconds."""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time

import pytest

from ci.release.publish import PublishError, RetryPolicy, publish_release
from ci.release.publish._net import retrying
from conftest_publish import sage_wheel
from github_faults import FaultyGitHub
from test_publish_github import FULL, TOKEN, assert_complete, opts

pytestmark = pytest.mark.timeout(180)


class VirtualClock:
    """Per-thread virtual time: ``sleep`` advances the calling thread's clock only."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.slept = 0.0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return getattr(self._local, "t", 0.0)

    def sleep(self, seconds: float) -> None:
        self._local.t = self.monotonic() + seconds
        with self._lock:
            self.slept += seconds

    def now(self) -> float:
        return time.time() + self.monotonic()


def _virtual(policy: RetryPolicy, clock: VirtualClock) -> RetryPolicy:
    return dataclasses.replace(policy, clock=clock.monotonic, sleep=clock.sleep, now=clock.now)


def _eight_wheels(tmp_path):
    d = tmp_path / "wheels"
    for v in ("cu130.torch2.10.stable", "cu128.torch2.10.stable", "cu132.torch2.10.stable", "cu128.torch2.8"):
        for plat in ("manylinux_2_28_x86_64", "manylinux_2_28_aarch64"):
            sage_wheel(d, v, platform=plat, payload=os.urandom(1024))
    return d


def test_the_eight_wheel_harsh_fault_publish_converges_with_the_defaults(tmp_path):
    wheels = _eight_wheels(tmp_path)
    clock = VirtualClock()
    uploads = r"^/api/uploads/"
    with FaultyGitHub(TOKEN) as gh:
        gh.add_repo(FULL)
        gh.inject("403", "POST", uploads, times=12, retry_after=60)          # secondary limits
        gh.inject("ratelimit", None, None, times=8, retry_after=240)         # primary limit spent
        gh.inject("429", "POST", uploads, times=6, retry_after=30)
        gh.inject("500", "POST", uploads, times=10)
        gh.inject("502", None, r"/releases", times=4)
        gh.inject("drop", "POST", uploads, times=5)
        gh.inject("drop_after", "POST", uploads, times=4)
        gh.inject("ratelimit", "GET", r"/assets", times=3, retry_after=90)
        logs: list[str] = []
        t0 = time.monotonic()
        s = publish_release(opts(gh, wheels, concurrency=4, retry=_virtual(RetryPolicy(), clock)), TOKEN,
                            log=logs.append)
        assert time.monotonic() - t0 < 120  # no real sleeping
        assert not s.failed and s.published and len(s.uploaded) == 17  # 8 wheels, 8 records, SHA256SUMS
        assert_complete(gh, wheels)
        assert all(f.times == 0 for f in gh.faults), [f for f in gh.faults if f.times]
    retries = [int(m.group(1)) for m in map(re.compile(r": retry (\d+) in ").search, logs) if m]
    # what a count of 6 attempts (the old default) would have given up on
    assert max(retries) >= 6, retries
    assert clock.slept >= 12 * 60 + 240  # the server's waits honoured (a reset already passed in a thread's time is not waited for again)
    assert all(re.search(r"s of the retry budget left\)$", m) for m in logs if ": retry " in m)


def test_a_request_gives_up_past_its_budget_and_says_what_to_change():
    clock = VirtualClock()
    policy = _virtual(RetryPolicy(budget=300), clock)
    from github import GithubException

    calls = []

    def limited():
        calls.append(clock.monotonic())
        raise GithubException(403, {"message": "You have exceeded a secondary rate limit."}, {"Retry-After": "60"})
    with pytest.raises(PublishError, match=r"^x\.whl: upload: still failing after 6 attempts in 300s .*waiting 60s more "
                                           r"would pass the retry budget of 300s \(--retry-budget\): re-run later"):
        retrying(limited, "x.whl: upload", policy, log=lambda m: None)
    assert calls == [0, 60, 120, 180, 240, 300]


def test_the_cli_waits_out_a_primary_rate_limit_reset(tmp_path):
    """The command line with its defaults, for real (a reset 1 s ahead: X-RateLimit-Reset, no
    Retry-After), and --retry-budget too small for it: stopped with what to change."""
    import subprocess
    import sys

    from conftest_publish import REPO

    wheels = tmp_path / "wheels"
    sage_wheel(wheels, "cu130.torch2.10.stable")
    with FaultyGitHub(TOKEN) as gh:
        gh.add_repo(FULL)
        env = {**os.environ, "GITHUB_TOKEN": TOKEN}
        cmd = [sys.executable, "-m", "ci.release.publish", "github", "--tag", "v1.0.0", "--repo", FULL, "--api-url", gh.api_url,
               "--wheels", str(wheels), "--write-interval", "0", "--allow-local-build"]
        gh.inject("ratelimit", "POST", r"^/api/uploads/", times=1, retry_after=1)
        gh.inject("ratelimit", "GET", r"/releases", times=1, retry_after=60)
        p = subprocess.run([*cmd, "--retry-budget", "30"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "--retry-budget" in p.stderr and "re-run later" in p.stderr, p.stderr
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert re.search(r"upload: retry 1 in [12]\.\ds \(HTTP 403 rate limited", p.stdout), p.stdout
        assert_complete(gh, wheels)
        p = subprocess.run([*cmd, "--retry-budget", "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "--retry-budget 0: must be more than 0" in p.stderr
