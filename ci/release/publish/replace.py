"""Replacing an asset of a release without a window where its name holds nothing.

GitHub names are unique on a release and an asset cannot be overwritten, so a replacement goes
in three steps (``python -m ci.release.publish github --replace``, and every rewrite of ``SHA256SUMS``):

1. upload the new bytes under a temporary name, ``<name>.replacement`` (not a ``.whl``: never a
   second wheel of the target);
2. retire the old asset by renaming it ``<name>.retired`` (its bytes stay on the release), then
   rename the replacement to ``<name>``;
3. once every asset is in place and ``SHA256SUMS`` vouches for the new bytes, delete the
   retired assets.

A run stopped after any request leaves the old or the new bytes on the release; the next run
reads the leftovers and finishes: a replacement with the local bytes whose name is free is
renamed (:func:`leftovers` and the plan's ``finish``), an older ``.retired`` is deleted before
retiring again, and any ``.replacement`` or ``.retired`` still there at the end is deleted.
The one state that is not "every name in place" lasts from the retiring rename to the next
request, the rename that puts the replacement in place.
"""

from __future__ import annotations

import dataclasses

TEMP = ".replacement"
RETIRED = ".retired"


def is_transient(name: str) -> bool:
    """A name this module gives assets for the length of a replacement."""
    return name.endswith((TEMP, RETIRED))


def rename(pub, release: dict, a: dict, new_name: str) -> dict:
    """Rename an asset (PATCH), reconciling an answer lost on the way by looking."""
    from github import GithubException
    from github.GitReleaseAsset import GitReleaseAsset

    from ci.release.publish.release_api import _raw

    def go() -> dict:
        pub.throttle()
        asset = pub.client.gh().create_from_raw_data(GitReleaseAsset, a)
        return _raw(asset.update_asset(new_name, a.get("label") or ""))

    def landed() -> dict | None:
        cur = pub.list_assets(release, f"{new_name}: look for it on the release").get(new_name)
        return cur if cur is not None and cur.get("id") == a.get("id") else None

    try:
        return pub._call(go, f"{a['name']}: rename to {new_name}", before_retry=landed)
    except GithubException as e:
        got = landed() if e.status == 422 else None  # the rename landed and its answer was lost
        if got is None:
            raise
        return got


def replace(pub, release: dict, la, old: dict, assets: dict[str, dict]) -> dict:
    """Steps 1 and 2 for one asset: returns the asset now under ``la.name`` (the new bytes)."""
    temp_name, retired_name = la.name + TEMP, la.name + RETIRED
    temp = assets.get(temp_name)
    if temp is not None:
        sha, _ = pub.remote_sha256(temp, la, {temp_name: temp})
        if sha != la.sha256:  # a replacement of another run, with other bytes
            pub._delete_asset(temp)
            temp = None
    if temp is None:
        temp = pub.upload(release, dataclasses.replace(la, name=temp_name), None)
    if retired_name in assets:  # retired by an earlier replacement: the live asset is `old`
        pub._delete_asset(assets[retired_name])
    state = "draft" if release.get("draft") else "PUBLISHED"
    if la.kind != "sums":
        pub.log(f"  {la.name}: replacing the asset of the {state} release {pub.opts.tag} "
                f"({old.get('size')} bytes{', ' + old['digest'] if old.get('digest') else ''} -> "
                f"{la.size} bytes, sha256:{la.sha256})")
    rename(pub, release, old, retired_name)
    return rename(pub, release, temp, la.name)


def finish(pub, release: dict, la, temp: dict) -> dict:
    """A replacement left by an interrupted run, its name free: put it in place."""
    pub.log(f"  {la.name}: finishing the replacement an interrupted run left ({temp['name']})")
    return rename(pub, release, temp, la.name)


def clean_up(pub, release: dict) -> list[str]:
    """Step 3: delete every temporary and retired asset still on the release."""
    gone = []
    for name, a in sorted(pub.list_assets(release).items()):
        if is_transient(name):
            pub._delete_asset(a)
            gone.append(name)
    return gone
