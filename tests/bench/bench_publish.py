"""Benchmark: index generation for 5,000 wheel records, and the request count of publishing a
full release (~1,000 assets) to the fake GitHub server. Plain script:

    python tests/bench/bench_publish.py [--records 5000] [--wheels 499]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]

from ci import index as ix  # noqa: E402
from ci.release.publish import RetryPolicy, ReleaseOptions, publish_release  # noqa: E402
from ci.stages.record import RECORD_IN_WHEEL, BuildRecord, record_path  # noqa: E402
from ci.toolchain.variant import Variant  # noqa: E402
from conftest_publish import build_wheel, os_key_of  # noqa: E402
from ci.release.github_standin import GitHubStandin  # noqa: E402

LINES = ("2.10", "2.11", "2.12", "2.13", "2.14")


def synthetic(d: Path, n: int) -> list[BuildRecord]:
    """n tiny wheels (versions x variants x platforms) with records, made fast."""
    recs = []
    variants = ["cu130.torch2.10.stable", "cu132.torch2.10.stable", "cu128.torch2.10.stable", "cu128.torch2.8", "cu129.torch2.8"]
    plats = ["manylinux_2_28_x86_64", "manylinux_2_28_aarch64", "win_amd64"]
    i = 0
    while len(recs) < n:
        for v in variants:
            for p in plats:
                if len(recs) >= n:
                    break
                version = f"1.{i // 100}.{i % 100}"
                var = Variant.parse(v)
                inner = BuildRecord(target=f"t{i}", variant=v, version=f"{version}+{v}", requires_torch=var.requires_torch,
                                    requires_python=">=3.10", torch_build="", cuda=var.cuda, archs=("sm_120a",),
                                    os=os_key_of(p), toolchain={}, flags={}, patches=(), source_commit="0" * 40,
                                    extra={"torch_lines": list(LINES) if var.stable else [var.torch]})
                inside = {k: x for k, x in json.loads(inner.to_json()).items() if k not in ("wheel", "sha256", "size")}
                w = build_wheel(d, "sageattn3", f"{version}+{v}", f"cp310-abi3-{p}", requires=(var.requires_torch,),
                                requires_python=">=3.10", files={RECORD_IN_WHEEL: json.dumps(inside).encode()})
                rec = inner.with_wheel(w)
                recs.append(rec)
        i += 1
    return recs


def bench_index(n: int) -> None:
    with tempfile.TemporaryDirectory() as t:
        t = Path(t)
        t0 = time.perf_counter()
        recs = synthetic(t / "w", n)
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = ix.update_index(recs, t / "w", t / "idx")
        full = time.perf_counter() - t0
        t0 = time.perf_counter()
        r2 = ix.update_index(recs, t / "w", t / "idx")
        again = time.perf_counter() - t0
        entries = {k: ix.Entry.from_dict(v) for k, v in ix.load_manifest(t / "idx")["wheels"].items()}
        t0 = time.perf_counter()
        ix.render(entries)
        render = time.perf_counter() - t0
        print(f"index: {n} records (made in {made:.1f}s), {len(r.pages)} pages")
        print(f"  first write (copy wheels, extract METADATA, write {len(r.written)} files): {full:.2f} s")
        print(f"  re-run, nothing new ({len(r2.written)} files written):                      {again:.2f} s")
        print(f"  rendering every page from the manifest:                                  {render:.2f} s"
              f"   target < 2 s: {'ok' if max(again, render) < 2 else 'MISSED'}")


def bench_publish(n_wheels: int) -> None:
    token = "ghp_" + "b" * 36
    with tempfile.TemporaryDirectory() as t, GitHubStandin(token) as gh:
        t = Path(t)
        gh.add_repo("o/r")
        # One release holds one version: distinct names from python tags (cp310, cp311, ...).
        for i in range(n_wheels):
            v = "cu130.torch2.10.stable"
            var = Variant.parse(v)
            inner = BuildRecord(target=f"t{i}", variant=v, version=f"1.0.0+{v}", requires_torch=var.requires_torch,
                                requires_python=">=3.10", torch_build="", cuda=var.cuda, archs=("sm_120a",),
                                os="linux-x86_64", toolchain={}, flags={}, patches=(), source_commit="0" * 40,
                                extra={"torch_lines": list(LINES)})
            inside = {k: x for k, x in json.loads(inner.to_json()).items() if k not in ("wheel", "sha256", "size")}
            w = build_wheel(t / "w", "sageattn3", f"1.0.0+{v}", f"cp3{10 + i}-abi3-linux_x86_64",
                            requires=(var.requires_torch,), requires_python=">=3.10",
                            files={RECORD_IN_WHEEL: json.dumps(inside).encode()})
            record_path(w).write_text(inner.with_wheel(w).to_json())
        opts = ReleaseOptions(repo="o/r", tag="v1.0.0", wheels=t / "w", api_url=gh.api_url, write_interval=0,
                              retry=RetryPolicy(backoff=0.01), concurrency=4)
        t0 = time.perf_counter()
        s = publish_release(opts, token, log=lambda m: None)
        dt = time.perf_counter() - t0
        assets = len(s.uploaded)
        kinds = Counter(("upload" if r.path.startswith("/api/uploads/") else f"{r.method} {r.path.split('/')[-1]}")
                        for r in gh.requests)
        print(f"publish: {assets} assets ({n_wheels} wheels + records + SHA256SUMS) in {dt:.1f}s: "
              f"{len(gh.requests)} requests = {kinds['upload']} uploads + {len(gh.requests) - kinds['upload']} others "
              f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()) if k != 'upload')})")
        n = len(gh.requests)
        publish_release(opts, token, log=lambda m: None)
        print(f"  re-run of the complete release: {len(gh.requests) - n} requests, {gh.uploads() - kinds['upload']} uploads")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--wheels", type=int, default=499, help="499 wheels + 499 records + SHA256SUMS = 999 assets")
    a = ap.parse_args()
    bench_index(a.records)
    bench_publish(a.wheels)


if __name__ == "__main__":
    main()
