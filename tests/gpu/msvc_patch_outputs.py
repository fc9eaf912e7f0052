"""Helpers of the MSVC pointer-param patch GPU checks (tests/gpu/test_msvc_patch_gpu.py), usable
as a script against whichever sageattn3 wheel is importable (e.g. PYTHONPATH=<its --target dir>):

    python3 tests/gpu/msvc_patch_outputs.py save FILE   # outputs over CASES (+ leak/graph figures)
    python3 tests/gpu/msvc_patch_outputs.py error eager|capture   # how a C++-side op error arrives

The outputs of the unpatched test-flavour build, saved here, are compared bit for bit with the
patched build's by the test (SAGEATTN3_UNPATCHED_OUTPUTS=FILE)."""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

import torch

PATCH = "msvc-pointer-params"

# The attention test shapes (tests/gpu/test_attn_fp4.py): dtype x D x causal x Sq (B=2, Hq=8,
# Hkv=1, per-block Q means), plus Sq != Sk, GQA, one Q mean, and one long sequence.
SEQS = (1, 127, 128, 1000, 4096)
CASES: list[dict] = [
    dict(dtype=dt, d=d, causal=c, sq=s, sk=s, b=2, hq=8, hk=1, pbm=True)
    for dt in ("bfloat16", "float16") for d in (64, 128) for c in (False, True) for s in SEQS
] + [
    dict(dtype="bfloat16", d=128, causal=False, sq=300, sk=1000, b=2, hq=8, hk=1, pbm=True),
    dict(dtype="float16", d=64, causal=True, sq=1000, sk=300, b=2, hq=8, hk=1, pbm=True),
    dict(dtype="bfloat16", d=128, causal=True, sq=777, sk=777, b=1, hq=8, hk=2, pbm=True),
    dict(dtype="float16", d=128, causal=False, sq=513, sk=513, b=3, hq=4, hk=4, pbm=False),
    dict(dtype="bfloat16", d=128, causal=True, sq=32768, sk=32768, b=1, hq=1, hk=1, pbm=True),
]


def case_id(c: dict) -> str:
    return (f"{c['dtype']}-D{c['d']}-{'causal' if c['causal'] else 'full'}-Sq{c['sq']}-Sk{c['sk']}"
            f"-B{c['b']}-Hq{c['hq']}-Hkv{c['hk']}{'' if c['pbm'] else '-onemean'}")


def preprocessed(c: dict, seed: int = 0):
    """Deterministic inputs (CPU generator), preprocessed by the reference (pure torch)."""
    from sageattn3 import reference as ref

    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, c["dtype"])
    q = torch.randn(c["b"], c["hq"], c["sq"], c["d"], generator=g) + torch.randn(c["d"], generator=g)
    k = torch.randn(c["b"], c["hk"], c["sk"], c["d"], generator=g) + 3 * torch.randn(c["d"], generator=g)
    v = torch.randn(c["b"], c["hk"], c["sk"], c["d"], generator=g) + 2 * torch.randn(c["d"], generator=g)
    q, k, v = (x.to(dt).cuda() for x in (q, k, v))
    return ref.preprocess(q, k, v, per_block_mean=c["pbm"], pad=128)


def run(c: dict, pre=None) -> torch.Tensor:
    from sageattn3 import _attn

    pre = preprocessed(c) if pre is None else pre
    out = _attn.attention_from_preprocessed(pre, is_causal=c["causal"], out_dtype=getattr(torch, c["dtype"]))
    torch.cuda.synchronize()
    return out


def raw_call(pre, out: torch.Tensor, causal: bool = False) -> None:
    """The op itself on padded inputs and a preallocated output (no allocation per call but
    delta_s's workspace, from torch's allocator)."""
    from sageattn3 import _attn

    torch.ops.sageattn3.blockscaled_fp4_attn(
        pre.q_packed.view(torch.uint8), pre.q_scales.view(torch.uint8), pre.k_packed.view(torch.uint8),
        pre.k_scales.view(torch.uint8), pre.v_packed.view(torch.uint8), pre.v_scales.view(torch.uint8),
        _attn.v_exp_bytes(pre.v_exp, out.device), pre.mean_q, pre.mean_q_global, pre.delta_key,
        torch.empty(0, device=out.device) if pre.k_residual is None else pre.k_residual,
        _attn.delta_s_workspace(out.shape[0], out.shape[1], pre.mean_q.shape[2], int(pre.seq_q),
                                pre.k_packed.shape[2], out.device), out, int(pre.seq_q),
        int(pre.seq_k),
        1.0 / (2 * pre.q_packed.shape[-1]) ** 0.5 * (64.0 / (2 * pre.q_packed.shape[-1]) if pre.qk_rotation else 1.0),
        causal)


# -- the default stream-ordered pool (what cudaMallocAsync draws from), through the driver API ----
_POOL_ATTR = {"reserved": 5, "reserved_high": 6, "used": 7, "used_high": 8}  # CU_MEMPOOL_ATTR_*


def default_pool_stats() -> dict:
    """Reserved/used bytes (current and high-water) of the device's default memory pool, or {}."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, pool = ctypes.c_int(), ctypes.c_void_p()
        if cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()) != 0:
            return {}
        if cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev) != 0:
            return {}
        out = {}
        for name, attr in _POOL_ATTR.items():
            v = ctypes.c_uint64()
            if cu.cuMemPoolGetAttribute(pool, attr, ctypes.byref(v)) != 0:
                return {}
            out[name] = v.value
        return out
    except OSError:
        return {}


def launches(n: int = 10_000) -> dict:
    """n launches of a small attention; device memory (cudaMemGetInfo) and the default pool before
    and after, each after a synchronize; microseconds per call."""
    c = dict(dtype="bfloat16", d=64, causal=False, sq=128, sk=128, b=1, hq=1, hk=1, pbm=True)
    pre = preprocessed(c)
    out = torch.empty(1, 1, 128, 64, dtype=torch.bfloat16, device="cuda")
    for _ in range(10):  # module load, pool creation, allocator warm-up
        raw_call(pre, out)
    torch.cuda.synchronize()
    first = out.clone()
    free0, total = torch.cuda.mem_get_info()
    pool0, alloc0 = default_pool_stats(), torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(n):
        raw_call(pre, out)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info()
    return {
        "n": n, "free_before": free0, "free_after": free1, "total": total,
        "torch_allocated_before": alloc0, "torch_allocated_after": torch.cuda.memory_allocated(),
        "pool_before": pool0, "pool_after": default_pool_stats(), "us_per_call": dt / n * 1e6,
        "same_output": bool(torch.equal(first.view(torch.uint8), out.view(torch.uint8))),
    }


def graph_capture() -> dict:
    """Captures one call in a CUDA graph and replays it. Returns the outcome: 'error' (with the
    message) or 'replayed', with whether three replays match the eager output bit for bit and
    whether a replay after new data was copied into the captured inputs matches an eager call on
    that data; then whether an eager call after the capture still matches."""
    c = dict(dtype="bfloat16", d=128, causal=True, sq=300, sk=300, b=1, hq=2, hk=1, pbm=True)
    pre, pre2 = preprocessed(c, seed=0), preprocessed(c, seed=1)
    out = torch.empty(1, 2, 300, 128, dtype=torch.bfloat16, device="cuda")
    raw_call(pre2, out, causal=True)
    torch.cuda.synchronize()
    want2 = out.clone()
    raw_call(pre, out, causal=True)
    torch.cuda.synchronize()
    want = out.clone()
    res: dict = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch recommends before capture
        raw_call(pre, out, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    out.zero_()
    g = torch.cuda.CUDAGraph()
    same = lambda a, b: bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))  # noqa: E731
    try:
        with torch.cuda.graph(g):
            raw_call(pre, out, causal=True)
    except RuntimeError as e:
        res.update(outcome="error", message=str(e).splitlines()[0])
    else:
        torch.cuda.synchronize()
        res.update(outcome="replayed", untouched_by_capture=bool((out == 0).all()))
        ok = True
        for _ in range(3):
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            ok &= same(out, want)
        res["replay_matches"] = ok
        # every input the call reads (raw_call): codes, scales, V's tile exponents, the means,
        # delta_s's key row and K's residual
        names = tuple(n for n in ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales", "v_exp",
                                  "mean_q", "mean_q_global", "delta_key", "k_residual") if getattr(pre, n) is not None)
        for n in names:
            getattr(pre, n).copy_(getattr(pre2, n))
        g.replay()
        torch.cuda.synchronize()
        res["replay_new_data_matches"] = same(out, want2)
        for n in names:
            getattr(pre, n).copy_(getattr(preprocessed(c, seed=0), n))
    out.zero_()
    raw_call(pre, out, causal=True)
    torch.cuda.synchronize()
    res["eager_after_matches"] = same(out, want)
    return res


def error_probe(capture: bool) -> str:
    """Makes the op fail in C++ (a misaligned output: the launcher returns cudaErrorInvalidValue,
    the binding throws), eagerly or inside a graph capture; returns the Python error. Run it in a
    subprocess: whether the failure arrives as an exception is what it finds out."""
    c = dict(dtype="bfloat16", d=64, causal=False, sq=128, sk=128, b=1, hq=1, hk=1, pbm=True)
    pre = preprocessed(c)
    out = torch.empty(128 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(1, 1, 128, 64)
    try:
        if capture:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                raw_call(pre, out)
        else:
            raw_call(pre, out)
    except RuntimeError as e:
        return "RuntimeError: " + str(e).splitlines()[0]
    return "no error"


def save(path: Path) -> None:
    import sageattn3

    info = sageattn3.build_info()
    outs, times = {}, {}
    for c in CASES:
        t0 = time.perf_counter()
        outs[case_id(c)] = run(c).cpu()
        times[case_id(c)] = round(time.perf_counter() - t0, 3)
    torch.save({"build_info": info, "outputs": outs}, path)
    figures = {"patches": info.get("patches"), "cases": len(outs), "seconds": times,
               "launches": launches(), "graph_capture": graph_capture()}
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "error":  # error eager|capture
        print(error_probe(sys.argv[2] == "capture"), flush=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "save":
        save(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
