"""The MSVC pointer-param patch (patches/msvc-pointer-params.patch) on the GPU, against the
INSTALLED wheel. Skips without CUDA, and unless that wheel's build record lists the patch (a
test-flavour build on an H100: `python3 -m ci build-wheels --test-flavour --force-patch
msvc-pointer-params`, or tests/gpu/msvc_patch_build.py for plain pip builds).

- bit-identical outputs to the unpatched build over the attention test shapes: the unpatched
  build's outputs come from `python3 tests/gpu/msvc_patch_outputs.py save FILE` run against it,
  named by SAGEATTN3_UNPATCHED_OUTPUTS=FILE (skips without it);
- 10,000 launches leave device memory where it started (cudaMemGetInfo after a synchronize, and
  the default stream-ordered pool's used bytes back to zero);
- CUDA graph capture gives correct results: a captured memcpy would re-read the launcher's dead
  stack frame at every replay, so under capture the patched launcher copies the params with a
  one-block kernel that takes them as 16-byte words by value (captured with the graph); the
  stream-ordered alloc/free become the graph's memory alloc/free nodes. Replays match the eager
  output bit for bit, also after new data is copied into the captured inputs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from attn_common import attn_or_skip
from msvc_patch_outputs import CASES, PATCH, case_id, graph_capture, launches, run


@pytest.fixture(scope="module")
def patched():
    sageattn3 = attn_or_skip()
    info = sageattn3.build_info()
    if PATCH not in (info.get("patches") or []):
        pytest.skip(f"the installed wheel was not built with {PATCH} (build record patches: {info.get('patches')})")
    return sageattn3


def test_binary_has_pointer_entry(patched):
    """The record and the binary agree: the kernel entries take `const AttnParams*`."""
    so = next(Path(patched.__file__).parent.glob("_C*.so"))
    blob = so.read_bytes()
    # every instantiation (<D, kInLoopResidual, kQK8, kPV8, kQK16>, kQK16 an int) takes the pointer,
    # none the struct
    by_pointer = set(re.findall(rb"fp4_attn_fwd_kernelI(Li\d+E(?:Lb[01]E)+Li\dE)EEvPKNS0_10AttnParamsE", blob))
    by_value = set(re.findall(rb"fp4_attn_fwd_kernelI(Li\d+E(?:Lb[01]E)+Li\dE)EEvNS0_10AttnParamsE", blob))
    want = {b"Li128ELb0ELb0ELb0ELi0E", b"Li64ELb1ELb0ELb0ELi0E", b"Li128ELb0ELb1ELb0ELi1E", b"Li128ELb0ELb1ELb1ELi2E"}
    assert want <= by_pointer and not by_value, (by_pointer, by_value)


@pytest.fixture(scope="module")
def unpatched_outputs():
    path = os.environ.get("SAGEATTN3_UNPATCHED_OUTPUTS")
    if not path:
        pytest.skip("SAGEATTN3_UNPATCHED_OUTPUTS not set (save them with msvc_patch_outputs.py under the unpatched wheel)")
    saved = torch.load(path)
    assert PATCH not in (saved["build_info"].get("patches") or []), "the saved outputs come from a patched build"
    return saved["outputs"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bit_identical_to_unpatched(patched, unpatched_outputs, case):
    want = unpatched_outputs[case_id(case)]
    got = run(case).cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
    assert diff == 0, f"{case_id(case)}: {diff} of {got.numel()} outputs differ from the unpatched build"


def test_10k_launches_leave_memory_where_it_started(patched):
    r = launches(10_000)
    print(f"\n10k launches: free {r['free_before']} -> {r['free_after']} B, default pool {r['pool_before']} -> "
          f"{r['pool_after']}, torch allocated {r['torch_allocated_before']} -> {r['torch_allocated_after']}, "
          f"{r['us_per_call']:.1f} us/call")
    assert r["same_output"]
    assert r["free_after"] == r["free_before"], f"device memory moved by {r['free_before'] - r['free_after']} B"
    assert r["torch_allocated_after"] == r["torch_allocated_before"]
    if r["pool_after"]:
        assert r["pool_after"]["used"] == 0, r["pool_after"]
        assert r["pool_after"]["reserved"] == r["pool_before"]["reserved"], (r["pool_before"], r["pool_after"])
        assert r["pool_after"]["used_high"] > 0, "the launches drew nothing from the default pool"


def test_graph_capture_replays_correctly(patched):
    r = graph_capture()
    print(f"\ngraph capture: {r}")
    assert r["outcome"] == "replayed", r
    assert r["untouched_by_capture"], "capturing ran the kernel"
    assert r["replay_matches"] and r["replay_new_data_matches"], r
    assert r["eager_after_matches"], r
