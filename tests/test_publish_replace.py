"""``publish github --replace --replace-published`` stopped at every step (the loopback GitHub
stand-in halts as a crashed server would after the n-th mutating request): the release never
loses a target's bytes nor holds two wheels of one target, and the next run finishes the
replacement (ci.release.publish.replace).

What this does not promise, because GitHub has no atomic swap of two assets (names are unique
and a rename is one request): between the rename that retires the old asset and the rename
that puts the replacement in place, the wheel's name is absent (its bytes are on the release
as ``<name>.retired`` and ``<name>.replacement``); and until ``SHA256SUMS`` is itself replaced,
its line for the wheel may still give the old hash. The checks below allow exactly those
states and nothing else."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from ci.release.publish import RetryPolicy, publish_release
from ci.release.publish.github import SUMS, parse_sums
from ci.release.publish.replace import RETIRED, TEMP
from conftest_publish import sage_wheel
from ci.release.github_standin import GitHubStandin
from github_faults import FaultyGitHub
from test_publish_github import FULL, TOKEN, VARIANTS, assert_complete, opts

pytestmark = pytest.mark.timeout(180)

QUICK = RetryPolicy(attempts=2, backoff=0.01, max_backoff=0.02, max_wait=1)
# The replacing run, one asset at a time: per replaced asset (the wheel, its record, SHA256SUMS)
# an upload under the temporary name and two renames, then the retired assets deleted.
WRITES = 3 * 3 + 3


def _files(gh: GitHubStandin) -> dict[str, bytes]:
    (rel,) = gh.release_by_tag(FULL, "v1.0.0")
    return gh.asset_files(FULL, rel["id"])


def _rebuild(wheels: Path, tmp_path: Path) -> str:
    rebuilt = tmp_path / "rebuilt"
    w, _ = sage_wheel(rebuilt, "cu128.torch2.8", payload=os.urandom(64))
    for p in rebuilt.iterdir():
        (wheels / p.name).write_bytes(p.read_bytes())
    return w.name


def _check_never_a_hole(files: dict[str, bytes], old: dict[str, bytes], new: dict[str, bytes], victim: str) -> None:
    """What holds at every stop: no second wheel of any target; every replaced name's old or
    new bytes are on the release (under the name or its temporary/retired name; the name alone
    may be absent for the one request between the two renames); untouched assets untouched;
    every line of SHA256SUMS (or of its replacement, while SHA256SUMS is being swapped) is the
    old or the new one, and it vouches for every wheel not being replaced."""
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert sorted(n for n in files if n.endswith(".whl")) in (sorted(n for n in old if n.endswith(".whl")),
                                                              sorted(n for n in old if n.endswith(".whl") and n != victim))
    for name in old:
        if name in (victim, victim + ".json", SUMS):
            held = {files.get(name), files.get(name + TEMP), files.get(name + RETIRED)} - {None}
            assert held & {old[name], new[name]}, f"{name}: neither its old nor its new bytes are on the release"
            if name in files:
                assert files[name] in (old[name], new[name]), name
        else:
            assert files.get(name) == old[name], f"{name} changed or went"
    sums = files.get(SUMS) or files.get(SUMS + TEMP)
    assert sums is not None
    lines = parse_sums(sums)
    for name, s in lines.items():
        assert s in (sha(old[name]), sha(new[name])), name
    for name in files:
        if name.endswith(".whl") and name != victim:
            assert lines[name] == sha(files[name]), f"{name}: not vouched for by {SUMS}"


@pytest.mark.parametrize("stop", range(WRITES + 2), ids=lambda n: f"after-{n}-writes")
def test_a_replacement_stopped_after_any_write_keeps_old_or_new_bytes_and_a_rerun_finishes_it(tmp_path, stop):
    wheels = tmp_path / "wheels"
    for v in VARIANTS:
        sage_wheel(wheels, v, payload=os.urandom(2048))
    with FaultyGitHub(TOKEN) as gh:
        gh.add_repo(FULL)
        publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
        old = _files(gh)
        victim = _rebuild(wheels, tmp_path)
        replace = opts(gh, wheels, replace=True, replace_published=True, concurrency=1, retry=QUICK)
        gh.halt_after(stop)
        try:
            publish_release(replace, TOKEN, log=lambda m: None)
            finished = True
        except Exception:  # noqa: BLE001 - the server went away: whatever the client raises
            finished = False
        assert finished == (stop > WRITES)  # the last one: every write made, the server gone before the check
        gh.resume()
        files = _files(gh)
        new = {**old, **{p.name: p.read_bytes() for p in wheels.iterdir() if p.name.startswith(victim)}}
        new[SUMS] = b"".join(f"{hashlib.sha256(new[n]).hexdigest()}  {n}\n".encode() for n in sorted(new) if n != SUMS)
        _check_never_a_hole(files, old, new, victim)
        # the next run (the same command) finishes it
        s = publish_release(opts(gh, wheels, replace=True, replace_published=True), TOKEN, log=lambda m: None)
        assert not s.failed
        assert_complete(gh, wheels)
        assert not [n for n in _files(gh) if n.endswith((TEMP, RETIRED))]


def test_the_old_order_would_leave_a_hole(tmp_path):
    """The check above is not vacuous: deleting the asset before uploading its replacement (the
    old behaviour), stopped in between, fails it."""
    wheels = tmp_path / "wheels"
    for v in VARIANTS:
        sage_wheel(wheels, v, payload=os.urandom(2048))
    with GitHubStandin(TOKEN) as gh:
        gh.add_repo(FULL)
        publish_release(opts(gh, wheels), TOKEN, log=lambda m: None)
        old = _files(gh)
        victim = _rebuild(wheels, tmp_path)
        (rel,) = gh.release_by_tag(FULL, "v1.0.0")
        with gh.lock:
            for aid in [i for i, a in gh.repos[FULL].assets.items() if a["name"] == victim]:
                del gh.repos[FULL].assets[aid]
        new = {**old, **{p.name: p.read_bytes() for p in wheels.iterdir() if p.name.startswith(victim)}}
        with pytest.raises(AssertionError, match="neither its old nor its new bytes"):
            _check_never_a_hole(_files(gh), old, new, victim)
