"""The safety net of the FP4 path: a known-answer check on the first FP4 call on each device.

Nobody who wrote the sm_120 kernel could run it on real Blackwell hardware (it was verified on
an H100 through a software model of the FP4 MMA). So before ``sageattn3_blackwell`` trusts the
kernel on a device, it runs six small attentions (256 x 256 each: D 128 bf16 GQA 2:1
non-causal, D 64 fp16 causal, both with FP4 Q·Kᵀ; D 128 bf16 GQA 2:1 with MXFP8 Q·Kᵀ on every
head, the path "auto" takes for the heads that need it, whose block-scaled FP8 MMA was likewise
only run through a software model; D 64 bf16 causal with the 16-bit Q·Kᵀ (bf16 rows: what
D 64 heads that leave FP4 multiply) on rows the preprocessing rotated, the path "auto" takes
with ``qk_rotation``; D 64 fp16 GQA 2:1 with "auto" itself, whose rule gives the second head,
its Q times ``PEAKY`` (near-one-hot rows), the 16-bit Q·Kᵀ and keeps the first in FP4: the rule
kernel and the per-head launches of a default call at D 64; and D 128 fp16 GQA 2:1 with "auto",
whose second head, its Q times ``MASSIVE``, multiplies the raw 16-bit rows (the rule's second
statistic, the D 128 path of massive outliers) beside an FP4 one; a handful of small kernel
launches, microseconds of GPU time) and compares them with ``sageattn3.reference.sageattn3``
computed on the CPU. On a mismatch: ONE loud ``RuntimeWarning`` with the figures, and
``sageattn3_blackwell`` uses torch SDPA on that device for the rest of the process. The FP8 P·V
kernels get their own check (``PV8_CASES``: every head, and the rule's per-head path) on a
device's first call that may take them (``pv_precision="fp8"``, or the default "auto" with the
rule on); if it fails, such calls run NVFP4 P·V there (one warning).
``SAGEATTN3_SKIP_SELFCHECK=1`` skips the check. Cost: a few small kernel launches on the GPU plus the reference on the CPU: the whole check took 31 ms on an
H100 host (113 ms as the first kernel calls of a process, which load the kernels), where the
MMA-model test flavour's software MMA made the two calls take 5.7 ms of GPU time.

Why 256 tokens: Q's offset differs between its two 128-token blocks (-4 and +4 times a
per-channel offset), so the block residuals r = mean_q - mean_q_global are large and the kernel's
whole correction runs (r · K̂ from K's codes and quantization residual, per key tile), not only
delta_key. On these inputs an attention that dropped K's residual from the correction would be
off by a relative L2 error of 0.09-0.13, one that ignored r by 0.7, one that took the other
block's r by 1.0 (reference variants, measured on the CPU): all fail the bars below. Smaller
faults in the residual (one value in eight lost, say) land near the bars; the residual's exact
bytes are checked by the GPU tests, not here.

Why the thresholds are what they are. The inputs are dyadic (multiples of 1/8, |x| <= 32): every
sum of 256 of them, every mean (sum / 128 or / 256) and every difference x - mean is exact in
float32, in any summation order. So the kernel's preprocessing and the reference produce bit-identical NVFP4
codes and scales for Q, K and V: the same quantization on both sides. What remains are float32
rounding differences: accumulation order in Q·Kᵀ, P·V and the correction delta_s (~1e-6
relative), the hardware exp2 (~2 ulp), which can flip a rare P code sitting on an FP4 rounding
boundary, and the rounding of the output to bf16/fp16 (2^-9 relative, a cos-sim loss of ~1e-6).
Expected: 1 - cos-sim of order 1e-5 or less. A wrong kernel (fragment layout, scale selector,
masking, a missed rescale) gives an output as far from the reference as a different algorithm:
1 - cos-sim of order 1e-2, larger than the FP4 quantization noise itself (1 - cos-sim(reference,
exact) ~ 5e-3 to 1e-2 on these inputs: a kernel that skipped the quantization would fail too).
The bar, cos-sim >= 0.999, sits two orders of magnitude above the benign level and below the
noise floor. cos-sim ignores scale, so the relative L2 error must also stay <= 0.05 (what cos-sim
0.999 allows for equal norms is 0.045), and everything must be finite.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

SKIP_ENV = "SAGEATTN3_SKIP_SELFCHECK"
MIN_COS = 0.999
MAX_REL_L2 = 0.05

# (batch, q heads, kv heads, seq, head_dim, dtype, causal, Q·Kᵀ precision, other options of the
# call): two 128-token Q blocks each. This group's case with Q·Kᵀ precision "auto" has its last
# q head's Q times PEAKY (``_inputs``).
# The FP8 Q·Kᵀ cases pin P·V to NVFP4: the FP8 P·V kernels have their own group.
CASES = (
    (1, 2, 1, 256, 128, torch.bfloat16, False, "fp4", {}),
    (1, 1, 1, 256, 64, torch.float16, True, "fp4", {}),
    (1, 2, 1, 256, 128, torch.bfloat16, False, "fp8", {"pv_precision": "fp4"}),
    # (what a call with qk_rotation=True runs: the rotation brings the scale search)
    (1, 2, 1, 256, 64, torch.bfloat16, True, "fp8",
     {"qk_rotation": True, "qk_scale_search": True, "pv_precision": "fp4"}),
    # the rule at D 64: head 0 estimates 0.06 (FP4), head 1 0.29 (the 16-bit Q·Kᵀ; the limit is 0.2)
    (1, 2, 1, 256, 64, torch.float16, False, "auto", {"pv_precision": "fp4"}),
    # the rule at D 128: head 0 FP4 (0.06), head 1 (Q times MASSIVE) the raw 16-bit rows (its
    # estimate 0.51-0.57, qk16_stat 45 against the limit 15)
    (1, 2, 1, 256, 128, torch.float16, False, "auto", {"pv_precision": "fp4"}),
)
# The FP8 P·V kernels (FP4 and FP8 Q·Kᵀ), checked on a device's first call that may take them
# (pv_precision "fp8", or "auto" with the rule): every head, and the rule's per-head path
# (blockscaled_attn_mixed, V's MXFP8 of the chosen kv heads) with a limit of 0, so that every head
# of the case takes it (these inputs estimate far below the real limit).
PV8_CASES = (
    (1, 2, 1, 256, 128, torch.bfloat16, False, "fp4", {"pv_precision": "fp8"}),
    (1, 1, 1, 256, 64, torch.float16, True, "fp8", {"pv_precision": "fp8"}),
    # the other two FP8 P.V kernels: FP4 Q.K^T at D 64 (the defaults' large-logit heads there),
    # MXFP8 Q.K^T at D 128
    (1, 1, 1, 256, 64, torch.bfloat16, False, "fp4", {"pv_precision": "fp8"}),
    (1, 2, 1, 256, 128, torch.float16, True, "fp8", {"pv_precision": "fp8"}),
    # (its last head's Q times MASSIVE: the raw 16-bit rows with FP8 P.V)
    (1, 2, 1, 256, 128, torch.bfloat16, True, "auto", {"pv_precision": "auto", "pv_limit": 0.0}),
)
GROUPS = {"default": CASES, "pv8": PV8_CASES}
Q_DRIFT = 4  # Q's offset per block: -Q_DRIFT, +Q_DRIFT times a per-channel offset of up to 1
PEAKY = 4  # the last q head's Q in an "auto" case: scores 4x wider, the rule's estimate 0.06 -> 0.29
# The last q head's Q in an "auto" case at D 128 (both groups): scores 32x wider, qk16_stat 1.4 -> 45,
# so that head multiplies the raw 16-bit rows (exact products of these dyadic inputs)
MASSIVE = 32


@dataclass
class Result:
    ok: bool
    device: str
    figures: list[dict] = field(default_factory=list)  # one per case
    error: str | None = None  # an exception raised by the kernel, if any
    gpu_ms: float | None = None  # CUDA events around the kernel calls (launch gaps included)
    left_out: list[str] = field(default_factory=list)  # cases whose path this process cannot take
    wall_ms: float = 0.0  # whole check, CPU reference included

    def summary(self) -> str:
        if self.error:
            return f"the kernel raised {self.error}"
        parts = []
        for f in self.figures:
            parts.append(
                f"D={f['head_dim']} {f['dtype']}{' causal' if f['causal'] else ''} {f['qk']} Q·Kᵀ"
                f"{' (' + f['options'] + ')' if f.get('options') else ''}: cos-sim {f['cos']:.6f} "
                f"(need >= {MIN_COS}), rel L2 {f['rel_l2']:.2e} (need <= {MAX_REL_L2}), max abs error "
                f"{f['max_err']:.3e} (output max {f['ref_max']:.3f}; reference vs exact cos-sim {f['ref_exact_cos']:.5f})"
            )
        return "; ".join(parts)


_results: dict[str, Result] = {}
_lock = threading.Lock()
run_count = 0  # how many checks ran in this process (tests)


_GROUP_KEYS: dict = {}  # (device, group) -> _group_key's answer, for devices that name their index


def _group_key(device, group: str) -> str:
    """The cache key of ``group``'s check on ``device`` (the default group's is the device's).
    Asked on every call that may take FP8 P·V: kept per (device, group) where the device names its
    index (a bare "cuda" means the current device, asked each time)."""
    key = _GROUP_KEYS.get((device, group))
    if key is None:
        d = torch.device(device)
        key = _key(d) + ("" if group == "default" else f" [{group}]")
        if d.type != "cuda" or d.index is not None:
            _GROUP_KEYS[(device, group)] = key
    return key


def _key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "").strip() == "1"


def result(device) -> Result | None:
    """The cached result for ``device`` (None: not run yet in this process)."""
    return _results.get(_key(device))


def pv8_usable(device, attention) -> bool:
    """Whether calls asking for FP8 P·V on ``device`` may run it: its check (group "pv8") passed,
    was skipped, or cannot run yet (CUDA graph capture); run here on the first such call."""
    r = ensure(device, attention, "pv8")
    return r is None or r.ok


def failure(device) -> Result | None:
    r = _results.get(_key(device))
    return r if r is not None and not r.ok else None


_reset_hooks: list = []


def on_reset(fn) -> None:
    """Call ``fn()`` on every ``reset()`` (caches built on the results: api's per-device paths)."""
    _reset_hooks.append(fn)


def reset() -> None:
    """Forget every cached result, and what was decided from them (tests)."""
    global run_count
    with _lock:
        _results.clear()
        run_count = 0
    for fn in _reset_hooks:
        fn()


def describe(device) -> str:
    """One line for ``sageattn3.backend()``."""
    if skipped():
        return f"self-check skipped ({SKIP_ENV}=1)"
    r = result(device)
    if r is None:
        return "self-check runs on the first call"
    worst = min((f["cos"] for f in r.figures), default=float("nan"))
    gpu = f", GPU span {r.gpu_ms * 1e3:.0f} us" if r.gpu_ms is not None else ""
    out = f"self-check {'passed' if r.ok else 'FAILED'}: worst cos-sim {worst:.6f}{gpu}"
    out += "".join(f"; left out: {x}" for x in r.left_out)
    pv8 = _results.get(_group_key(device, "pv8"))
    if pv8 is not None:
        out += f"; FP8 P·V self-check {'passed' if pv8.ok else 'FAILED (every head runs NVFP4 P·V)'}"
    return out


def fallback_reason(r: Result) -> str:
    return f"the FP4 self-check failed on {r.device}: {r.summary()}"


def _dyadic(gen: torch.Generator, shape, scale_offset: int) -> torch.Tensor:
    """Multiples of 1/8 with |x| <= 4 (exact in bf16/fp16; sums of 128 exact in float32): a
    spread of +-2 plus a per-channel offset of up to +-scale_offset (what the smoothing removes).
    At this scale the FP4 quantization noise is 1 - cos-sim(reference, exact) ~ 5e-3 to 1e-2."""
    x = torch.randint(-16, 17, shape, generator=gen).float()
    off = torch.randint(-8, 9, (shape[-1],), generator=gen).float() * scale_offset
    return (x + off) / 8


def _inputs(case, seed: int):
    b, hq, hk, s, d, dtype = case[:6]
    g = torch.Generator().manual_seed(seed)
    q = _dyadic(g, (b, hq, s, d), 1)
    k = _dyadic(g, (b, hk, s, d), 2)
    v = _dyadic(g, (b, hk, s, d), 1)
    # Q's block means drift: block 0 gets -Q_DRIFT x the offset, the last block +Q_DRIFT x
    off = torch.randint(-8, 9, (d,), generator=g).float() / 8
    blk = torch.arange(s) // 128
    ramp = 2 * blk.float() / max(1, int(blk[-1])) - 1
    q = q + Q_DRIFT * ramp[:, None] * off
    if case[7] == "auto" and d == 128:  # the rule's cases at D 128: the last head takes the raw rows
        q[:, -1] *= MASSIVE
    elif case[7] == "auto" and case in CASES:  # the rule's case: its last head leaves FP4
        q[:, -1] *= PEAKY
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _figures(out: torch.Tensor, ref_out: torch.Tensor, exact: torch.Tensor) -> dict:
    from sageattn3 import reference

    o, r = out.double().cpu(), ref_out.double()
    diff = o - r
    finite = bool(torch.isfinite(o).all())
    return {
        "finite": finite,
        "cos": reference.cosine_similarity(o, r) if finite else float("nan"),
        "rel_l2": float(diff.norm() / r.norm().clamp_min(1e-300)) if finite else float("inf"),
        "max_err": float(diff.abs().max()) if finite else float("inf"),
        "ref_max": float(r.abs().max()),
        "ref_exact_cos": reference.cosine_similarity(r, exact.double()),
    }


def _passes(f: dict) -> bool:
    return f["finite"] and f["cos"] >= MIN_COS and f["rel_l2"] <= MAX_REL_L2


def run(device, attention, cases=CASES) -> Result:
    """Run the check's ``cases`` on ``device`` with ``attention(q, k, v, is_causal,
    per_block_mean, qk_precision=..., **options)`` (the FP4 path) and return the result (not
    cached)."""
    from sageattn3 import reference

    global run_count
    run_count += 1
    device = torch.device(device)
    t0 = time.perf_counter()
    res = Result(ok=True, device=_key(device))
    cases = [(c, _inputs(c, seed=20250 + i)) for i, c in enumerate(cases) if _runnable(c, res)]
    outs = []
    try:
        ctx = torch.cuda.device(device) if device.type == "cuda" else _null()
        with ctx:
            dev_in = [tuple(t.to(device) for t in qkv) for _, qkv in cases]
            ev = None
            if device.type == "cuda":
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            for (c, _), (q, k, v) in zip(cases, dev_in):
                outs.append(attention(q, k, v, c[6], True, qk_precision=c[7], **c[8]))
            if ev is not None:
                ev[1].record()
                ev[1].synchronize()
                res.gpu_ms = ev[0].elapsed_time(ev[1])
            outs = [o.float().cpu() for o in outs]
    except Exception as e:  # noqa: BLE001  (any failure of the kernel is a failed check)
        res.ok, res.error = False, f"{type(e).__name__}: {e}"
        res.wall_ms = (time.perf_counter() - t0) * 1e3
        return res
    for (c, (q, k, v)), out in zip(cases, outs):
        b, hq, hk, s, d, dtype, causal, precision, opts = c
        ref_out = reference.sageattn3(q, k, v, is_causal=causal, per_block_mean=True, qk_precision=precision, **opts)
        exact = reference.exact_attention(q, k, v, is_causal=causal)
        if tuple(out.shape) != tuple(ref_out.shape):
            res.ok, res.error = False, f"output shape {tuple(out.shape)} != {tuple(ref_out.shape)}"
            break
        f = _figures(out, ref_out, exact)
        f.update(head_dim=d, dtype=str(dtype).replace("torch.", ""), causal=causal, qk=precision,
                 options=", ".join(f"{k}={v!r}" for k, v in opts.items()))
        res.figures.append(f)
        res.ok = res.ok and _passes(f)
    res.wall_ms = (time.perf_counter() - t0) * 1e3
    return res


def _runnable(case, res: Result) -> bool:
    """Whether calls in this process can take the case's path. The FP8 Q·Kᵀ kernel reads delta_s
    rows, which the bounded-memory mode (``SAGEATTN3_DELTA_S_WORKSPACE_MIB`` too small for them)
    does not keep: then "auto" never picks FP8 (its case, where the reference gives one head the
    precise Q·Kᵀ, would not match) and "fp8" raises, so the check leaves the case out (noted in
    ``res.left_out``) instead of failing on a path no call takes."""
    from sageattn3 import _attn

    b, hq, _, s, _, _, _, precision, opts = case
    pv8 = opts.get("pv_precision") in ("fp8", "auto")  # FP8 P·V reads delta_s rows too
    if precision == "fp4" and not pv8:
        return True
    try:
        fits = _attn.fp8_workspace_fits(b, hq, -(-s // _attn.SEQ_PAD), s, -(-s // _attn.SEQ_PAD) * _attn.SEQ_PAD)
    except ValueError:
        return True  # a malformed limit: the call itself raises the message that names it
    if not fits:
        what = f"{precision} Q·Kᵀ" + (" with FP8 P·V" if pv8 else "")
        res.left_out.append(f"{what} (the delta_s workspace, {_attn.WORKSPACE_ENV}, holds no row)")
    return fits


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def ensure(device, attention, group: str = "default") -> Result | None:
    """The check of ``group`` (``GROUPS``: "default", the paths every call can take; "pv8", the
    FP8 P·V kernels, which the rule or pv_precision="fp8" may take) for ``device``, run once per process (cached): returns the result, or
    None when skipped (``SAGEATTN3_SKIP_SELFCHECK=1``) or impossible right now (inside CUDA graph
    capture; the next call outside capture runs it). On a failure, warns once, loudly."""
    key = _group_key(device, group)
    r = _results.get(key)
    if r is not None:
        return r
    if skipped():
        return None
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    with _lock:
        r = _results.get(key)
        if r is not None:
            return r
        r = run(device, attention, GROUPS[group])
        _results[key] = r
    if not r.ok:
        name = ""
        if torch.device(device).type == "cuda":
            try:
                cc = torch.cuda.get_device_capability(device)
                name = f" ({torch.cuda.get_device_name(device)}, sm_{cc[0]}{cc[1]})"
            except Exception:  # noqa: BLE001
                pass
        what, then = ("FP4", "sageattn3_blackwell falls back to torch scaled_dot_product_attention")
        if group == "pv8":
            what, then = ("FP8 P·V", "sageattn3_blackwell runs NVFP4 P·V instead (pv_precision 'fp8' and 'auto')")
        warnings.warn(
            f"sageattn3: {what} SELF-CHECK FAILED on {key}{name}. The {what} attention kernel disagrees with "
            f"sageattn3.reference on a known-answer test: {r.summary()}. {then} on this device for the rest of "
            f"this process. Please report this with sageattn3.build_info() and your GPU/driver; {SKIP_ENV}=1 "
            "skips the check.",
            RuntimeWarning,
            stacklevel=4,
        )
    return r
